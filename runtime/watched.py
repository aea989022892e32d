"""`WatchedFiles`: the export files a loaded model reads through memory maps, watched for changes in place.

onnxruntime maps an export's `onnx/weights.safetensors` into memory instead of reading it. Writing
that file in place (truncating it, overwriting it) while a model uses it changes what the model
computes with, and touching a page past a truncated end kills the process with SIGBUS. Replacing the
file by a rename (what `paradecode-export --force` does) is safe: the map keeps the old file.

So a model keeps each mapped file open, and `check()` compares the open file's size and modification
time with what they were at load (`os.fstat` on the descriptor: the file the map holds, wherever its
name now points). A changed file raises `ExportChangedError` before the model touches its pages.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from paradecode.graphs.errors import ExportChangedError


class WatchedFiles:
    """Open descriptors of `paths` and their (size, mtime) at load; `close()` releases them. Thread-safe reads."""

    def __init__(self, paths: Iterable[Path]):
        self._files: dict[Path, tuple[int, tuple[int, int]]] = {}
        try:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                self._files[Path(path)] = (fd, self._signature(fd))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _signature(fd: int) -> tuple[int, int]:
        stat = os.fstat(fd)
        return stat.st_size, stat.st_mtime_ns

    def changed(self) -> list[str]:
        """How each changed file changed, e.g. "onnx/weights.safetensors: 1024 -> 512 bytes"; [] when none did."""
        found = []
        for path, (fd, (size, mtime)) in self._files.items():
            now_size, now_mtime = self._signature(fd)
            if now_size != size:
                found.append(f"{path}: {size} -> {now_size} bytes")
            elif now_mtime != mtime:
                found.append(f"{path}: written in place (modified after it was loaded)")
        return found

    def check(self) -> None:
        """Raise ExportChangedError if a watched file changed since it was loaded."""
        if self._files and (changed := self.changed()):
            raise ExportChangedError(
                f"the export's files changed on disk while this model serves them ({'; '.join(changed)}). The "
                "weights are memory-mapped, so decoding with them could crash the process: nothing more is decoded. "
                "Restart (reload) once the export is whole again; re-export with --force, which replaces files "
                "by renaming them, to update an export that is being served."
            )

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
