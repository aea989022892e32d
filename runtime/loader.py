"""An export folder as the runtime sees it: the manifest, checked files, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR, Manifest, read_manifest, verify_files


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    manifest: Manifest

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.manifest.model.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.manifest.model.get("bos_token_id")
        return bos if isinstance(bos, int) else None

    def file(self, relative: str) -> Path:
        """The path of a file the manifest names."""
        return self.path / relative

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.path / TOKENIZER_DIR / "tokenizer.json"
        return path if f"{TOKENIZER_DIR}/tokenizer.json" in self.manifest.tokenizer else None


def open_export(path: str | Path, verify: bool = True) -> ExportFolder:
    """Read `path/manifest.json`; with `verify`, check every file exists with its recorded sha256."""
    path = Path(path)
    if not path.is_dir():
        raise UserInputError(f"{path} is not a folder. Pass the folder written by `paradecode-export MODEL -o DIR`.")
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    return ExportFolder(path, manifest)
