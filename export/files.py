"""Writing an export: a staged folder renamed into place at the end, file modes, weights, hashes."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import MANIFEST_NAME, FileRecord
from paradecode.graphs.ops import TORCH_DTYPES


@contextmanager
def staged_folder(output: Path, force: bool):
    """Yield a temporary folder beside `output`; rename it to `output` only if the block succeeds."""
    created = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield tmp
        publishable(tmp)
        if output.exists():
            if not force:
                raise UserInputError(f"output folder {output} appeared during the export; pass --force to replace it.")
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(old / output.name)
            tmp.rename(output)
            shutil.rmtree(old)
        else:
            tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in reversed(created):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise


def publishable(folder: Path) -> None:
    """Give the staged folder the modes a normal mkdir/open would have (mkdtemp makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def save_weights(path: Path, weights: dict[str, torch.Tensor], dtype: str) -> None:
    """Canonical weights for the torch backend, in the export dtype (rotary frequencies stay float32)."""
    from safetensors.torch import save_file

    cast = {
        k: (v if k == "rope.inv_freq" else v.to(TORCH_DTYPES[dtype])).detach().contiguous().clone()
        for k, v in weights.items()
    }
    save_file(cast, str(path), metadata={"format": "paradecode-weights/1"})


def file_hashes(folder: Path) -> dict[str, FileRecord]:
    """The sha256 and size of every file in `folder` but the manifest, by relative POSIX path."""
    return {
        p.relative_to(folder).as_posix(): FileRecord.of(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paradecode")
    except PackageNotFoundError:
        return "unknown"
