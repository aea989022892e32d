"""Which weights an export stores quantized, and how: `--weights auto|float|int8|int4`.

- `auto` keeps a GGUF file's own quantized blocks exactly (export/gguf_blocks.py) and is `float` for
  other sources;
- `float` stores every weight in the export's dtype (dense);
- `int8` / `int4` quantize a float model's matrices blockwise (weight-only, 32 values a block; int4 with
  a zero point per block, int8 symmetric) with onnxruntime's own quantizer, as its MatMulNBits reads them.

Only the matrices a token's compute reads are quantized (`graphs.quantization_manifest.QUANTIZABLE`): the layers'
projections, the embedding and the unembedding (tied or not), and the exit heads' reduced unembedding.

A GGUF tensor is matched to the weight transformers made of it by its dequantized rows (bit for bit), not
by name: transformers reorders Q and K rows for Llama and splits GPT-2's fused QKV, and a match by rows
follows whatever it did, then proves that the kept blocks give exactly the float weight the export is
validated against.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from paradecode.export.gguf_blocks import quantized_from_gguf, supported
from paradecode.graphs.quantization_manifest import WeightFormat, quantizable
from paradecode.graphs.quantized_weights import QuantizedWeight

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32  # int8/int4: onnxruntime-genai's CPU block size; every GGUF type but Q6_K (16) uses 32 too
HASH_CHUNK = 1 << 22  # values hashed at a time


def quantized_weights(
    setting: str, gguf_path: Path | None, weights: dict[str, torch.Tensor]
) -> dict[str, QuantizedWeight]:
    """The canonical weights to store quantized under `setting`, by name (empty: a float export)."""
    if setting == "float" or (setting == "auto" and gguf_path is None):
        return {}
    if setting == "auto":
        return from_gguf(gguf_path, weights)
    return from_float(weights, bits=4 if setting == "int4" else 8)


def head_quantized(
    quantized: dict[str, QuantizedWeight], weights: dict[str, torch.Tensor], vocab: torch.Tensor | None
) -> dict[str, QuantizedWeight]:
    """The exit heads' reduced unembedding: the quantized unembedding's rows of `vocab` (blocks as they are)."""
    source = "unembed.weight" if "unembed.weight" in weights else "embed.tokens.weight"
    if vocab is None or source not in quantized:
        return {}
    return {"exits.unembed": quantized[source].rows(vocab.to(torch.int64))}


# --- int8 / int4 with onnxruntime's quantizer ----------------------------------------------------


def from_float(weights: dict[str, torch.Tensor], bits: int) -> dict[str, QuantizedWeight]:
    quantizer = _ort_quantizer(bits)
    out = {}
    for name, weight in weights.items():
        if not quantizable(name) or weight.dim() != 2:
            continue
        n, k = weight.shape
        # onnxruntime quantizes B of a MatMul, [K, N], along K: our [N, K] weight transposed.
        packed, scales, zero_points = quantizer.qbits_block_quant(weight.detach().to(torch.float32).t().numpy().copy())
        fmt = WeightFormat(
            source=f"int{bits}",
            bits=bits,
            block_size=BLOCK_SIZE,
            shape=(n, k),
            scales="float32",
            zero_points=bits == 4,
            mins=None,
        )
        out[name] = QuantizedWeight(
            fmt,
            torch.from_numpy(packed),
            torch.from_numpy(scales),
            torch.from_numpy(zero_points) if bits == 4 else None,
        )
    return out


def _ort_quantizer(bits: int):
    """onnxruntime's blockwise weight quantizer (the C++ kernels MatMulNBitsQuantizer uses)."""
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)  # the module calls logging.basicConfig at import: make that a no-op
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )
    finally:
        root.removeHandler(guard)
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK_SIZE, is_symmetric=bits == 8, bits=bits)
    return DefaultWeightOnlyQuantizer(config)


# --- a GGUF file's own blocks ------------------------------------------------------------------


def row_hashes(rows: torch.Tensor) -> np.ndarray:
    """A 64-bit hash of each row's float32 bits (rows [N, K]), for matching rows bit for bit."""
    k = rows.shape[1]
    multipliers = np.random.default_rng(k).integers(1, 2**63, size=k, dtype=np.uint64) | np.uint64(1)
    out = np.empty(rows.shape[0], dtype=np.uint64)
    step = max(1, HASH_CHUNK // max(k, 1))
    for start in range(0, rows.shape[0], step):
        bits = rows[start : start + step].to(torch.float32).contiguous().numpy().view(np.uint32)
        with np.errstate(over="ignore"):
            out[start : start + step] = (bits.astype(np.uint64) * multipliers).sum(axis=1, dtype=np.uint64)
    return out


def from_gguf(path: Path, weights: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """Every quantizable weight whose rows a GGUF tensor of a supported block type holds, with its blocks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors: list[tuple[str, QuantizedWeight, dict[int, int]]] = []
    owners: dict[int, list[int]] = {}  # a row's hash -> the tensors holding such a row
    not_kept: Counter[str] = Counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2 or kind in ("F32", "F16", "BF16", "F64"):
            continue
        if not supported(kind):
            not_kept[kind] += 1
            continue
        quantized = quantized_from_gguf(np.asarray(tensor.data), kind, int(tensor.shape[0]))
        hashes = row_hashes(quantized.dequantize())
        index = {int(h): row for row, h in enumerate(hashes.tolist())}
        for h in set(index):
            owners.setdefault(h, []).append(len(tensors))
        tensors.append((tensor.name, quantized, index))
    if not_kept:
        logger.warning(
            "kept in float: %s (block types with no exact form in onnxruntime's MatMulNBits); "
            "pass --weights int4 or int8 to quantize them",
            ", ".join(f"{n} {kind} tensors" for kind, n in sorted(not_kept.items())),
        )
    out, unmatched = {}, []
    for name, weight in weights.items():
        if not quantizable(name) or weight.dim() != 2:
            continue
        match = _match_rows(weight, tensors, owners)
        if match is None:
            unmatched.append(name)
        else:
            out[name] = match
    if unmatched:
        logger.info(
            "%d weights stay float (no GGUF tensor of a kept block type holds their rows): %s",
            len(unmatched),
            ", ".join(unmatched[:6]) + (" ..." if len(unmatched) > 6 else ""),
        )
    return out


def _match_rows(
    weight: torch.Tensor, tensors: list[tuple[str, QuantizedWeight, dict[int, int]]], owners: dict[int, list[int]]
) -> QuantizedWeight | None:
    """The blocks of `weight`'s rows from the one GGUF tensor holding them all, checked bit for bit."""
    hashes = row_hashes(weight).tolist()
    for candidate in owners.get(int(hashes[0]), []):
        _, quantized, index = tensors[candidate]
        if quantized.format.shape[1] != weight.shape[1] or any(h not in index for h in hashes):
            continue
        picked = quantized.rows(torch.tensor([index[h] for h in hashes], dtype=torch.int64))
        exact = picked.dequantize().view(torch.int32)
        if torch.equal(exact, weight.detach().to(torch.float32).contiguous().view(torch.int32)):
            return picked
    return None
