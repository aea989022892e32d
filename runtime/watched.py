"""`WatchedFiles`: the files a model was loaded from, compared by content with what its export folder holds now.

A model reads its export at load into its own memory: a backend reads each file it computes with whole
(`ExportFolder.read`: its size and sha256 checked against the manifest, whatever `verify` says) and maps none,
and a graph opened later (onnxruntime opens a subgraph's session at its first call) is made from those bytes;
the tokenizer and chat template are read at load too. So nothing done to the folder afterwards changes what a
loaded model computes: writing a file in place, truncating it (which killed a process that mapped it with SIGBUS)
or replacing the folder by a rename (what `paradecode-export --force` does) cannot crash it or give it another
model's weights. The price is memory: the onnxruntime backend keeps the weights file's bytes for the model's life
(sessions are made from them), and onnxruntime copies the initializers it read from the map before. Measured after
load and a 40-token prompt decoded in ar and paradecode: SmolLM2-135M's int8 export (101 MB of weights) 761 MB
resident against 611 MB with the map; stories260K (1 MB of weights) 277 MB against 276.

What can still happen is that the folder no longer holds the export that was loaded. Then a model refuses to
start a request with `ExportChangedError` (checked as each request starts; a server answers 503 `export_changed`,
and so does its /health, with a log line), rather than answer as an export that is no longer in its folder; it
answers again once the loaded files are back. A request already decoding finishes with what it started with.

`check()` compares manifest.json and every file it lists, at the folder's path now, with what was loaded: a
file whose `os.stat` (device, inode, size, modification and change times) is the one last seen is unchanged
(about 10 us a file); any other stat gets the file hashed (sha256) and compared with its manifest record, once
per new stat. A writer cannot set the change time back, so an overwrite of the same size with its modification
time restored is hashed too; an identical copy renamed in is hashed once and found unchanged. manifest.json is
compared as the manifest it parses to (graphs/manifest.py's `read_manifest`).

Threading model: `check()` and `changed()` may run on any thread (replica workers, the server's event loop and
its preparation threads); `_lock` guards `_seen` and is held while a file is hashed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

from paradecode.graphs.errors import ExportChangedError, ParadecodeError
from paradecode.graphs.manifest import MANIFEST_NAME, Manifest, read_manifest
from paradecode.graphs.untrusted import HASH_BLOCK, OPEN_FLAGS, FileRecord

logger = logging.getLogger(__name__)

Signature = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
SHOWN = 3  # changed files a message names; it counts the others


def signature_of(status: os.stat_result) -> Signature:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


class WatchedFiles:
    """The files of the export `manifest` was read from in `folder`, as loaded: manifest.json and every file it
    lists (each one's FileRecord: size and sha256, which the backends' reads check)."""

    def __init__(self, folder: Path, manifest: Manifest):
        self.folder = Path(folder)
        self.manifest = manifest
        self._paths = {relative: os.path.join(folder, relative) for relative in (MANIFEST_NAME, *manifest.files)}
        # relative path -> (the stat it was last seen with, None where it was missing; how its content differs from
        # what was loaded, None where it does not)
        self._seen: dict[str, tuple[Signature | None, str | None]] = {}
        self._lock = threading.Lock()

    def seen(self, relative: str, status: os.stat_result) -> None:
        """Record that `relative` held the loaded content while its stat was `status` (taken before it was read)."""
        with self._lock:
            self._seen[relative] = (signature_of(status), None)

    def changed(self) -> list[str]:
        """How each changed file differs, e.g. "onnx/weights.safetensors: 1024 -> 512 bytes"; [] when none does."""
        found = []
        with self._lock:
            for relative, path in self._paths.items():
                difference = self._difference(relative, path)
                if difference is not None:
                    found.append(f"{relative}: {difference}")
        return found

    def check(self) -> None:
        """Raise ExportChangedError if the folder no longer holds the files this model was loaded from."""
        changed = self.changed()
        if changed:
            more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
            raise ExportChangedError(
                f"the export's files changed on disk after this model loaded them ({'; '.join(changed[:SHOWN])}"
                f"{more}). The model still holds what it loaded, but answers no request as an export that is no "
                "longer in its folder: restart (reload) it to serve what the folder holds now, or put back the "
                "files it loaded."
            )

    def _difference(self, relative: str, path: str) -> str | None:
        """How the file at `path` differs now (None: it holds what was loaded); hashed only where its stat is new."""
        try:
            now, difference = signature_of(os.stat(path)), None
        except OSError as err:
            now, difference = None, "missing" if isinstance(err, FileNotFoundError) else f"unreadable ({err.strerror})"
        last = self._seen.get(relative)
        if last is not None and last[0] == now:
            return last[1]
        if now is not None:
            try:
                now, difference = self._compare(relative, path)
            except OSError as err:  # it went while it was compared
                now, difference = None, f"unreadable ({err.strerror})"
        if difference is not None:  # once per change: the next check finds this stat in `_seen`
            logger.error("the loaded export's %s changed on disk: %s", relative, difference)
        self._seen[relative] = (now, difference)
        return difference

    def _compare(self, relative: str, path: str) -> tuple[Signature, str | None]:
        """(the stat of what was compared, how it differs from the loaded file or None)."""
        if relative == MANIFEST_NAME:
            before = signature_of(os.stat(path))  # taken before it is read, as at load
            try:
                same = read_manifest(self.folder) == self.manifest
            except ParadecodeError as err:
                return before, f"unreadable ({str(err).splitlines()[0][:200]})"
            return before, None if same else "another manifest (another export)"
        record: FileRecord = self.manifest.files[relative]
        try:
            fd = os.open(path, OPEN_FLAGS)
        except OSError as err:
            return signature_of(os.stat(path)), f"unreadable ({err.strerror})"
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                return signature_of(status), "not a regular file"
            if status.st_size != record.bytes:
                return signature_of(status), f"{record.bytes} -> {status.st_size} bytes"
            digest = hashlib.sha256()
            while block := f.read(HASH_BLOCK):
                digest.update(block)
            digest = digest.hexdigest()
        return signature_of(status), None if digest == record.sha256 else "other content of the same size"
