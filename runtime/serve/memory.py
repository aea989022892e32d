"""Whether a server's batches fit: the KV-cache bytes they need against the memory the device has, before allocating.

A replica that decodes `rows` requests together holds a KV cache of `rows` rows at the export's max length (its
engine, runtime/engine.py). On a CPU its pages cost memory only once a sequence reaches them, but a full batch
of long requests reaches them all, so the whole cache must fit in what is available once the models are loaded:
an export whose `limits.max_batch` is 1,000,000 would otherwise ask for tens of GB and fail (or be killed) later.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.runtime.model import ParaDecodeModel

# cgroup v2, then v1: a container's limit, which /proc/meminfo does not show
# (limit, usage, the usage's statistics file and its key for page cache the kernel may drop: as the kubelet counts a
# container's working set, usage less inactive file pages; the export just read is mostly such pages)
CGROUP_LIMITS = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def row_bytes(model: ParaDecodeModel) -> int:
    """The bytes one row of an engine's KV cache takes."""
    return model.backend.cache_bytes(1)


def available_bytes(device: torch.device) -> int | None:
    """The memory free for new buffers on `device`: a GPU's free memory, or the RAM this process may still take
    (MemAvailable, within its cgroup's limit); None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    found = [_meminfo_available()]
    for limit, usage, statistics, inactive in CGROUP_LIMITS:
        limit_text, usage_text = _read(limit), _read(usage)
        if limit_text is not None and usage_text is not None and limit_text.isdigit() and usage_text.isdigit():
            used = int(usage_text) - _statistic(statistics, inactive)
            found.append(max(0, int(limit_text) - max(0, used)))
    known = [size for size in found if size is not None]
    return min(known) if known else None


def _statistic(path: str, key: str) -> int:
    """A cgroup memory.stat counter (0 where the file or the key is missing)."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _meminfo_available() -> int | None:
    text = _read("/proc/meminfo")
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def size(count: int) -> str:
    """`count` bytes in the largest binary unit it holds once, and exactly."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit} ({count:,} bytes)"
    return f"{count:,} bytes"


def check_batches_fit(model: ParaDecodeModel, rows: int, replicas: int, given: bool) -> str:
    """Refuse `replicas` batches of `rows` rows that need more memory than `model`'s device has available; else say
    what they reserve (the server logs it at start).

    `given`: whether `rows` came from --max-batch (ServeConfig.max_batch) or from the export's limits.max_batch.
    """
    per_row = row_bytes(model)
    need = per_row * rows * replicas
    device = model.backend.device
    available = available_bytes(device)
    if available is None or need <= available:
        taken = (
            "taken as sequences reach their slots and given back when a replica has none left"
            if model.backend.grows_cache
            else "allocated at start"
        )
        free = size(available) if available is not None else "unknown"
        return (
            f"KV cache of {replicas} replica(s) x {rows} rows: at most {size(need)} ({size(per_row)} a row at "
            f"max_seq_len {model.manifest.max_seq_len}), {taken}; {device.type.upper()} memory available: {free}"
        )
    fit = available // (per_row * replicas)
    source = "--max-batch" if given else "the export's limits.max_batch; --max-batch serves fewer"
    fix = (
        f"serve with --max-batch {fit} or less" if fit > 1 else "serve with --max-batch 1 (one request at a time)"
    ) + (", or fewer --replicas" if replicas > 1 else "")
    raise UserInputError(
        f"{replicas} replica(s) decoding {rows} requests together ({source}) need {size(need)} of KV cache "
        f"({size(per_row)} a row at the export's max_seq_len {model.manifest.max_seq_len}), and this machine's "
        f"{device.type.upper()} memory has {size(available)} available: {fix}, or re-export with a smaller --max-batch."
    )
