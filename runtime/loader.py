"""An export folder as the runtime sees it: the manifest, checked files, and the tokenizer.

The folder is untrusted input (docs/design.md §7): every file the runtime opens goes through
`ExportFolder.file`, which resolves it inside the folder and accepts only files the manifest lists
with their sha256 and size; `open_export` checks those (the hashes too, unless `verify=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR, Manifest, read_manifest, verify_files
from paradecode.graphs.untrusted import listed_file


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    manifest: Manifest

    def file(self, relative: str) -> Path:
        """The path of `relative`, a file the manifest lists, resolved inside the folder.

        Refuses (ManifestError) a path that is absolute, has a `..` component, leads out of the
        folder through a symlink, is not listed in the manifest's files, or is not a regular file
        of its recorded size. Backends open files through this, never `path / relative`.
        """
        return listed_file(self.path, self.manifest.files, relative)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.manifest.model.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    @property
    def tokenizer_path(self) -> Path | None:
        relative = f"{TOKENIZER_DIR}/tokenizer.json"
        return self.file(relative) if relative in self.manifest.tokenizer else None


def open_export(path: str | Path, verify: bool = True) -> ExportFolder:
    """Read `path/manifest.json` and check every file it lists: inside the folder, present, of its
    recorded size and, with `verify`, of its recorded sha256."""
    path = Path(path)
    if not path.is_dir():
        raise UserInputError(f"{path} is not a folder. Pass the folder written by `paradecode-export MODEL -o DIR`.")
    manifest = read_manifest(path)
    verify_files(path, manifest, hashed=verify)
    return ExportFolder(path, manifest)
