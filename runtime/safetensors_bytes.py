"""One tensor of a safetensors file held in memory, read without deserializing the others.

A model reads its export's weights file into memory at load (runtime/watched.py says why); the one tensor
decoding needs from it (the exit heads' vocabulary) is read from those bytes. The bytes are untrusted: the
header's length, JSON, dtype, shape and offsets are checked, and an error names what arrived.
"""

from __future__ import annotations

import json
import math

import torch

from paradecode.graphs.errors import ManifestError

# safetensors' dtype names, those an export writes
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit


def tensor_from_safetensors(data: bytes, name: str, shown: str) -> torch.Tensor:
    """The tensor `name` of a safetensors file's bytes `data` (a copy), its header checked: `shown` names the
    file in errors. Reads one tensor of a file held in memory without deserializing the others."""
    if len(data) < 8:
        raise ManifestError(f"{shown} has {len(data)} bytes: too short for a safetensors file. Re-export the model.")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_SAFETENSORS_HEADER, len(data) - 8):
        raise ManifestError(f"{shown}: its safetensors header claims {size} bytes of {len(data)}. Re-export the model.")
    try:
        header = json.loads(data[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ManifestError(f"{shown}: its safetensors header is not JSON ({err}). Re-export the model.") from err
    entry = header.get(name) if isinstance(header, dict) else None
    if entry is None:
        raise ManifestError(f"{shown} has no tensor {name!r}. Re-export the model.")
    named = entry.get("dtype") if isinstance(entry, dict) else None
    dtype = SAFETENSORS_DTYPES.get(named) if isinstance(named, str) else None
    shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
    valid = (
        dtype is not None
        and isinstance(shape, list)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62 for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
    )
    if not valid:
        raise ManifestError(
            f"{shown}: the safetensors entry of {name!r} is {str(entry)[:200]}; expected a known dtype, a shape of "
            "non-negative integers and two data offsets. Re-export the model."
        )
    begin, end = offsets
    count = math.prod(shape)
    if not 0 <= begin <= end <= len(data) - 8 - size or end - begin != count * dtype.itemsize:
        raise ManifestError(
            f"{shown}: {name!r} ({entry['dtype']} {shape}) has data offsets {offsets}, outside its "
            f"{len(data) - 8 - size} bytes of data or not its size. Re-export the model."
        )
    if not count:
        return torch.empty(shape, dtype=dtype)
    start = 8 + size + begin
    return torch.frombuffer(bytearray(memoryview(data)[start : start + end - begin]), dtype=dtype).reshape(shape)
