"""Reading an export folder as untrusted input (docs/design.md §7).

JSON values are read through typed accessors whose errors name the field, what arrived and what
was expected. A path a manifest names is a relative POSIX path (no absolute path, no `..`, no
empty or `.` component) that resolves inside the folder: a symlink is followed only while its
target stays in the folder. A file is opened only if the manifest lists it with its size and
sha256; a file whose size differs from the recorded one is refused without being read, hashing
reads at most the recorded size plus one block, and no error prints a file's actual hash.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from paradecode.graphs.errors import ManifestError

HASH_BLOCK = 1 << 22
MAX_PATH_CHARS = 1024
PATH_SHOWN = MAX_PATH_CHARS + 2  # a path is shown whole (quoted) once its length is checked
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
REEXPORT = "Re-export the model: `paradecode-export MODEL -o DIR --force`."
# Open without blocking on a FIFO and without following a symlink swapped in after the check.
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def show(value: Any, limit: int = 120) -> str:
    """`value` for an error message, shortened: a message names what arrived without flooding the log."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- typed JSON values ------------------------------------------------------------------------


def json_field(data: dict, key: str, where: str) -> Any:
    """`data[key]`; `where` is the field path of `data` ("" at the top, else ending in ".")."""
    if key not in data:
        raise ManifestError(f"{where}{key} is missing.")
    return data[key]


def json_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} is {show(value)}; expected a JSON object.")
    return value


def json_array(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"{where} is {show(value)}; expected a JSON array.")
    return value


def json_integer(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(f"{where} is {show(value)}; expected an integer >= {minimum}.")
    return value


def json_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(f"{where} is {show(value)}; expected a finite number.")
    return float(value)


def json_string(value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        expected = f"one of {list(choices)}" if choices is not None else "a string"
        raise ManifestError(f"{where} is {show(value)}; expected {expected}.")
    return value


# --- paths ------------------------------------------------------------------------------------


def check_relative(value: Any, where: str) -> str:
    """`value` if it is a relative path that cannot leave its folder by its spelling alone."""
    expected = "a relative path inside the export folder, with '/' separators"
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where} is {show(value, PATH_SHOWN)}; expected {expected}.")
    if len(value) > MAX_PATH_CHARS:
        raise ManifestError(f"{where} is a path of {len(value)} characters; expected at most {MAX_PATH_CHARS}.")
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).anchor:
        raise ManifestError(f"{where} is {show(value, PATH_SHOWN)}, an absolute path; expected {expected}.")
    if "\\" in value or "\0" in value:
        raise ManifestError(f"{where} is {show(value, PATH_SHOWN)}, with a backslash or NUL; expected {expected}.")
    if any(part in ("", ".", "..") for part in value.split("/")):
        raise ManifestError(
            f"{where} is {show(value, PATH_SHOWN)}, with an empty, '.' or '..' component; expected {expected}."
        )
    return value


def resolve_inside(root: Path, relative: str, where: str) -> Path:
    """`root / relative` with symlinks resolved; refused if it leaves `root` (itself already resolved)."""
    check_relative(relative, where)
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise ManifestError(
            f"{where} is {show(relative, PATH_SHOWN)}, which resolves through a symlink to {path}: outside the export "
            f"folder {root}. Every file an export names must be inside its folder."
        )
    return path


def read_bounded(path: Path, shown: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, refused unread if it has more than `limit` bytes."""
    with _open_regular(path, shown) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ManifestError(f"{shown} has {size} bytes; expected at most {limit}. {REEXPORT}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ManifestError(f"{shown} grew past {limit} bytes while it was read. {REEXPORT}")
    return data


def _open_regular(path: Path, shown: str):
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        raise ManifestError(f"cannot open {shown} ({err.strerror}). {REEXPORT}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"{shown} is not a regular file; the export lists it as a file. {REEXPORT}")
    return os.fdopen(fd, "rb")


# --- files and their records ------------------------------------------------------------------


def sha256_of(path: Path, chunk: int = HASH_BLOCK) -> str:
    """The sha256 of a file the caller trusts (the exporter's own output, a model it reads)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records of one file: its sha256 (hex) and its size in bytes."""

    sha256: str
    bytes: int

    @classmethod
    def of(cls, path: Path) -> FileRecord:
        return cls(sha256_of(path), Path(path).stat().st_size)

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, value: Any, where: str) -> FileRecord:
        """A record from the manifest; an error names the arrived value's type, never a digest."""
        expected = "{'sha256': HEX, 'bytes': N} (format version 2 records each file's size)"
        if not isinstance(value, dict):
            raise ManifestError(f"{where} is a {type(value).__name__}; expected {expected}.")
        digest, size = value.get("sha256"), value.get("bytes")
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
            raise ManifestError(f"{where}.sha256 is not 64 lowercase hexadecimal digits; expected {expected}.")
        return cls(digest, json_integer(size, f"{where}.bytes", minimum=0))


def check_file(path: Path, shown: str, record: FileRecord, *, hashed: bool) -> None:
    """Check that `path` is a regular file of the recorded size and, if `hashed`, sha256.

    The file is opened once and checked through that descriptor: what is measured is what is hashed.
    """
    with _open_regular(path, shown) as f:
        size = os.fstat(f.fileno()).st_size
        if size != record.bytes:
            raise ManifestError(f"{shown} has {size} bytes, the manifest records {record.bytes}. {REEXPORT}")
        if not hashed:
            return
        digest, read = hashlib.sha256(), 0
        while read <= record.bytes and (block := f.read(HASH_BLOCK)):
            digest.update(block)
            read += len(block)
    if read != record.bytes:
        raise ManifestError(f"{shown} changed size while it was read: the manifest records {record.bytes} bytes.")
    if digest.hexdigest() != record.sha256:
        raise ManifestError(
            f"{shown} is corrupt: sha256 of its {read} bytes does not match the manifest's sha256. {REEXPORT}"
        )


def check_files(folder: Path, files: dict[str, FileRecord], *, hashed: bool = True) -> None:
    """Check every listed file: inside `folder`, present, regular, of the recorded size (and sha256)."""
    root = Path(folder).resolve()
    paths = {name: resolve_inside(root, name, f"files[{name!r}]") for name in files}
    missing = sorted(name for name, path in paths.items() if not path.exists())
    if missing:
        raise ManifestError(f"{folder} is missing files the manifest lists: {missing}. {REEXPORT}")
    for name, path in paths.items():
        check_file(path, str(Path(folder) / name), files[name], hashed=hashed)


def read_file(path: Path, shown: str, record: FileRecord) -> tuple[bytes, os.stat_result]:
    """The bytes of `path`, a regular file of the recorded size and sha256, and its stat from before they were read.

    Read through one descriptor: what is measured is what is hashed and returned.
    """
    with _open_regular(path, shown) as f:
        status = os.fstat(f.fileno())
        if status.st_size != record.bytes:
            raise ManifestError(f"{shown} has {status.st_size} bytes, the manifest records {record.bytes}. {REEXPORT}")
        data = f.read(record.bytes)
        grew = f.read(1)
    if len(data) != record.bytes or grew:
        raise ManifestError(f"{shown} changed size while it was read: the manifest records {record.bytes} bytes.")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise ManifestError(
            f"{shown} is corrupt: sha256 of its {len(data)} bytes does not match the manifest's sha256. {REEXPORT}"
        )
    return data, status


def _listed_record(files: dict[str, FileRecord], relative: str) -> FileRecord:
    record = files.get(relative) if isinstance(relative, str) else None
    if record is None:
        raise ManifestError(
            f"{show(relative)} is not among the files the manifest lists with their sha256: the runtime opens "
            f"only those. {REEXPORT}"
        )
    return record


def read_listed(folder: Path, files: dict[str, FileRecord], relative: str) -> tuple[bytes, os.stat_result]:
    """The bytes of `relative`, a file the manifest lists, resolved inside `folder` and checked against its record
    (size and sha256: see `read_file`), with its stat from before they were read."""
    record = _listed_record(files, relative)
    path = resolve_inside(Path(folder).resolve(), relative, f"files[{relative!r}]")
    return read_file(path, str(Path(folder) / relative), record)


def listed_file(folder: Path, files: dict[str, FileRecord], relative: str) -> Path:
    """The resolved path of `relative`, a file the manifest lists, checked to be inside `folder`,
    regular and of its recorded size (its sha256 is checked when the export is opened)."""
    record = _listed_record(files, relative)
    path = resolve_inside(Path(folder).resolve(), relative, f"files[{relative!r}]")
    check_file(path, str(Path(folder) / relative), record, hashed=False)
    return path
