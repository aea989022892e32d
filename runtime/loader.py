"""An export folder as the runtime sees it: the manifest, checked files, and the tokenizer.

The folder is untrusted input (docs/design.md §7): every file the runtime opens goes through
`ExportFolder.file` or `ExportFolder.read`, which resolve it inside the folder and accept only files the
manifest lists with their sha256 and size; `open_export` checks those (the hashes too, unless `verify=False`).
A backend reads what it computes with through `read`, into memory, its sha256 checked whatever `verify` says:
what a model was loaded from is known by content, and `files` (runtime/watched.py) compares the folder with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import MANIFEST_NAME, TOKENIZER_DIR, Manifest, read_manifest, verify_files
from paradecode.graphs.untrusted import listed_file, read_listed
from paradecode.runtime.watched import WatchedFiles


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    manifest: Manifest
    files: WatchedFiles = field(init=False, compare=False)  # the loaded files, compared with the folder by content

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", WatchedFiles(self.path, self.manifest))

    def file(self, relative: str) -> Path:
        """The path of `relative`, a file the manifest lists, resolved inside the folder.

        Refuses (ManifestError) a path that is absolute, has a `..` component, leads out of the
        folder through a symlink, is not listed in the manifest's files, or is not a regular file
        of its recorded size. Backends read files through `read`; this is for readers of a path.
        """
        return listed_file(self.path, self.manifest.files, relative)

    def read(self, relative: str) -> bytes:
        """The bytes of `relative`, a file the manifest lists (refused as `file` refuses it), of its recorded size
        and sha256: what a backend computes with, read once and never mapped (runtime/watched.py)."""
        data, status = read_listed(self.path, self.manifest.files, relative)
        self.files.seen(relative, status)
        return data

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
    before = _stat(path / MANIFEST_NAME)  # each stat before its file is read: see runtime/watched.py
    manifest = read_manifest(path)
    export = ExportFolder(path, manifest)
    listed = {name: _stat(path / name) for name in manifest.files}
    verify_files(path, manifest, hashed=verify)
    for name, status in {MANIFEST_NAME: before, **listed}.items():
        if status is not None:
            export.files.seen(name, status)
    return export


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:  # verify_files or read_manifest says what is wrong with it
        return None
