"""Writing an export: a staged folder renamed into place at the end, file modes, weights, hashes; and the
checks, before a long run, that its output (a folder, or a file such as a heads file or a report) can be written.

Failures while writing leave nothing behind, and a full disk (ENOSPC) or a reached quota (EDQUOT)
becomes an `OutOfSpaceError` that says how much the export needs, wherever in the writing it struck.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from paradecode.graphs.errors import OutOfSpaceError, UserInputError, exception_chain, raise_if_interrupted
from paradecode.graphs.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileRecord
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.graphs.quantized_weights import QuantizedWeight

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors) reports an OS error


def nearest_folder(path: Path) -> Path:
    """`path`'s nearest existing ancestor: where the first missing folder on the way to it would be made (which
    may be a file, then nothing can be made under it)."""
    return next(p for p in Path(path).absolute().parents if p.exists())


def probe_writable(folder: Path, name: str) -> None:
    """Create and remove a file in `folder` (raises OSError where that fails): not `os.access`, so read-only
    mounts, ACLs and full inode tables are caught too. Leaves nothing."""
    handle, probe = tempfile.mkstemp(prefix=f".{name}.probe-", dir=folder)
    os.close(handle)
    os.unlink(probe)


def check_folder_writable(output: Path) -> None:
    """Refuse early when the output folder `output` cannot be created (where `staged_folder` creates the first
    missing folder, or the staged folder)."""
    parent = nearest_folder(output)
    if not parent.is_dir():
        raise UserInputError(
            f"cannot create the output folder {output}: {parent} is a file, not a folder. Choose another -o path."
        )
    try:
        probe_writable(parent, output.name)
    except OSError as err:
        raise UserInputError(
            f"cannot create the output folder {output}: {parent} is not writable ({err.strerror}). "
            f"Choose another -o path, or make {parent} writable."
        ) from err


def check_output_folder(output: Path, force: bool) -> None:
    """Refuse early an output folder that the export could not publish, or whose replacing would lose what is not
    an export: a path that is not UTF-8 (ONNX stores file names as UTF-8), a symbolic link on the way that leads
    nowhere or loops, a link as the folder itself (publishing renames onto the path, which would replace the link),
    the root, home or current folder or one above it, a file, an existing folder without --force, a folder that is
    neither empty nor a paradecode export (--force replaces only those), one that cannot be moved aside."""
    try:
        os.fsencode(output.absolute()).decode("utf-8")
    except UnicodeDecodeError:
        shown = os.fsencode(output).decode("utf-8", "backslashreplace")
        raise UserInputError(
            f"the output path {shown} is not valid UTF-8 text, and ONNX stores the names of the files it writes as "
            "UTF-8. Choose an -o path whose folder names are UTF-8."
        ) from None
    for path in (output, *output.parents):
        if path.is_symlink() and not path.exists():
            why = "loops back on itself" if stat_errno(path) == errno.ELOOP else "does not exist"
            raise UserInputError(
                f"cannot create the output folder {output}: {path} is a symbolic link to {os.readlink(path)}, which "
                f"{why}. Remove or repair the link, or choose another -o path."
            )
    if output.is_symlink():
        raise UserInputError(
            f"output {output} is a symbolic link (to {os.readlink(output)}): an export is published by renaming a "
            f"finished folder onto its path, which would replace the link, not what it points to. Pass "
            f"-o {output.resolve()} to export there, or choose another -o path."
        )
    resolved, cwd = output.resolve(), Path.cwd()
    protected = {
        Path(resolved.anchor): "the root folder",
        cwd: "the current folder",
        Path.home().resolve(): "your home folder",
    }
    what = protected.get(resolved) or ("a parent of the current folder" if resolved in cwd.parents else None)
    if what is not None:
        raise UserInputError(
            f"output {output} is {what} ({resolved}): an export replaces its output folder as a whole. "
            f"Choose a new folder for it, e.g. -o {output / 'export'}."
        )
    if output.exists() and not output.is_dir():
        raise UserInputError(f"output {output} exists and is a file, not a folder. Choose another -o path.")
    if output.exists():
        if not replaceable(output):
            raise UserInputError(
                f"output folder {output} exists and is not a paradecode export (it has no {MANIFEST_NAME} written by "
                "paradecode-export) and not empty: --force replaces only an export or an empty folder, so that "
                "nothing else is deleted. Choose another -o path, or empty or remove the folder yourself."
            )
        if not force:
            raise UserInputError(
                f"output folder {output} already exists. Pass --force to replace it, or choose another -o path."
            )
        for folder in (output, *(p for p in output.rglob("*") if p.is_dir() and not p.is_symlink())):
            try:
                probe_writable(folder, output.name)
            except OSError as err:
                raise UserInputError(
                    f"cannot replace the output folder {output}: {folder} cannot be changed ({err.strerror}), so it "
                    "could not be moved aside and removed. Make it writable (`chattr -i` for an immutable "
                    "folder), or choose another -o path."
                ) from err
    check_folder_writable(output)


def stat_errno(path: Path) -> int | None:
    """The errno of stat(2) following `path`'s links (ENOENT, ELOOP, ...), or None when it succeeds."""
    try:
        os.stat(path)
    except OSError as err:
        return err.errno
    return None


def is_export(folder: Path) -> bool:
    """Whether `folder` holds a manifest paradecode-export wrote: a JSON object with its `format_version` (an
    integer: any version, so an old export can be replaced) and `subgraphs`. Reads at most the manifest's limit."""
    path = folder / MANIFEST_NAME
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):  # unreadable or not JSON (UnicodeDecodeError is a ValueError)
        return False
    return isinstance(data, dict) and type(data.get("format_version")) is int and "subgraphs" in data


def replaceable(folder: Path) -> bool:
    """What --force may replace: a paradecode export, or an empty folder (not one that cannot be listed)."""
    try:
        return is_export(folder) or not any(folder.iterdir())
    except OSError:
        return False


def check_file_writable(path: Path, option: str) -> None:
    """Refuse at once an output file that the end of a long run could not write: a folder, a path under a file, a
    folder that cannot be made or written in (the writers make missing folders), and a device, pipe or socket (the
    writers rename a finished file onto the path, which would replace it: /dev/null, as root)."""
    path = Path(path)
    if path.is_dir():
        raise UserInputError(f"{option} {path} is a folder; give a file name, e.g. {path / 'out'}.")
    if path.exists() and not path.is_file():
        raise UserInputError(
            f"{option} {path} is not a regular file (a device, a pipe or a socket): the output is written beside it "
            "and renamed onto it, which would replace it. Give a file name."
        )
    folder = nearest_folder(path)
    if not folder.is_dir():
        raise UserInputError(
            f"{option} {path}: {folder} is not a folder, so nothing can be written under it. Choose another path."
        )
    try:
        probe_writable(folder, path.name)
    except OSError as err:
        raise UserInputError(
            f"{option} {path} cannot be written: {folder} refuses new files ({err.strerror}). Choose another path "
            "before the run, so that its results are not lost at the end."
        ) from err


@contextmanager
def staged_folder(
    output: Path, force: bool, needed_bytes: int = 0, *, may_replace: Callable[[Path], bool] | None = None
):
    """Yield a temporary folder beside `output`; rename it to `output` only if the block succeeds.

    On any failure or interrupt the temporary folder and the parents created for it are removed, and
    a replaced `output` is put back. `needed_bytes` (an estimate) goes into the out-of-space message.
    With `may_replace`, an existing `output` is replaced only where it says so (checked again at the end: the
    folder may have appeared or changed while the block ran).
    """
    created = [p for p in reversed(output.parents) if not p.exists()]
    tmp = old = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
        yield tmp
        raise_if_interrupted()  # the point of no return: an interrupt a library swallowed still stops here
        publishable(tmp)
        if output.exists():
            if not force:
                raise UserInputError(f"output folder {output} appeared during the export; pass --force to replace it.")
            if may_replace is not None and not may_replace(output):
                raise UserInputError(
                    f"output {output} is neither a paradecode export nor an empty folder (it appeared or changed "
                    "during the export), so it was left as it is and nothing was written. Choose another -o path."
                )
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(old / output.name)
            tmp.rename(output)
            shutil.rmtree(old)
        else:
            tmp.rename(output)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if (old / output.name).exists() and not output.exists():
                (old / output.name).rename(output)
            shutil.rmtree(old, ignore_errors=True)
        for path in reversed(created):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        code = out_of_space_errno(err) if isinstance(err, Exception) else None  # an interrupt stays one
        if code is not None:
            raise OutOfSpaceError(
                f"{os.strerror(code).lower()} while writing {output}: the export needs at least "
                f"{megabytes(needed_bytes)}; free space or choose another -o. Nothing was written."
            ) from err
        raise


def out_of_space_errno(err: BaseException) -> int | None:
    """ENOSPC or EDQUOT when an OSError with one of them is `err` or in its chain of causes and contexts."""
    return next((e.errno for e in exception_chain(err) if isinstance(e, OSError) and e.errno in OUT_OF_SPACE), None)


def megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def export_bytes(weights: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight], dtype: str) -> int:
    """About how many bytes an export takes: the weights file holds every weight once (quantized ones as their
    blocks) and the ONNX graphs point into it (TensorRT engines, which hold their own weights, come on top)."""
    itemsize = TORCH_DTYPES[dtype].itemsize
    dense = sum(
        t.numel() * (itemsize if t.is_floating_point() else t.element_size())
        for name, t in weights.items()
        if name not in quantized
    )
    return dense + sum(t.numel() * t.element_size() for q in quantized.values() for t in q.parts().values())


def publishable(folder: Path) -> None:
    """Give the staged folder the modes a normal mkdir/open would have (mkdtemp makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def save_weights(
    path: Path, weights: dict[str, torch.Tensor], dtype: str, quantized: dict[str, QuantizedWeight] | None = None
) -> None:
    """The export's one weights file: every canonical weight once, in the export dtype (rotary frequencies
    and tables stay float32, token ids int64), a quantized one as its stored parts (`{name}.qweight`, ...). The torch
    backend loads it; every ONNX graph points into it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    quantized = quantized or {}
    cast = {
        k: (v if k.startswith("rope.") or not v.is_floating_point() else v.to(TORCH_DTYPES[dtype]))
        .detach()
        .contiguous()
        .clone()
        for k, v in weights.items()
        if k not in quantized
    }
    for name, weight in quantized.items():
        cast.update({k: v.contiguous() for k, v in weight.stored(name).items()})
    try:
        save_file(cast, str(path), metadata={"format": "paradecode-weights/1"})
    except SafetensorError as err:  # Rust's I/O errors arrive as text: give OS errors back their errno
        match = RUST_OS_ERROR.search(str(err))
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


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
