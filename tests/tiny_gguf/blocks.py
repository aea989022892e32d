"""GGUF block types of the tiny files' matrices, as raw bytes the way a GGUF file holds them.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are quantized from random float weights with `gguf.quants.quantize`.
gguf.quants can only dequantize the K-quants, so Q4_K, Q5_K and Q6_K blocks are written byte by byte:
random but valid: positive, normal fp16 super-block scales; random 6-bit sub-block scales over their
whole range, with minimums near half a sub-block's range (as llama.cpp's quantizer makes them, so the
weights straddle zero) plus noise; random quants. F32 and F16 are plain floats.

Every matrix's weights have a spread of `weight_std(row length)`: 0.2 for rows of 64, 0.1 for rows of
256, 0.05 for 1024, so that a layer's output has the same size whatever the hidden size (with 0.2 at
hidden 256 the residual stream after one layer is ~8x larger, beyond the exporter's float tolerances,
and greedy output collapses onto one token).

Block layouts (ggml-common.h; every block is 256 weights, multi-byte values little-endian):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit minimums, 128
  bytes of 4-bit quants; weight = d·scale_j·q − dmin·min_j in 32-weight sub-block j.
- Q5_K (176 bytes): as Q4_K, then 32 bytes of fifth bits before the 128 bytes of low nibbles.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen int8 scales,
  fp16 d; weight = d·scale_j·(q − 32) in 16-weight sub-block j.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
QUANTIZED_BY_GGUF = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
FLOATS = (T.F32, T.F16)
BLOCK_TYPES = (*QUANTIZED_BY_GGUF, *K_QUANTS)  # the quantized types the fixtures write
MATRIX_TYPES = (*BLOCK_TYPES, *FLOATS)  # what a matrix may be stored as
FP16_MIN_NORMAL = 6.2e-5  # just above fp16's smallest normal number (6.1e-5)

# general.file_type a file mostly of this type states (llama.cpp's names; transformers ignores it).
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32,
    T.F16: LlamaFileType.MOSTLY_F16,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    T.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    T.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    T.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    T.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    T.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}


def block_type(value: str | GGMLQuantizationType) -> GGMLQuantizationType:
    """`"Q4_K"` or `GGMLQuantizationType.Q4_K` -> the type, refusing what the fixtures cannot write."""
    qtype = value if isinstance(value, GGMLQuantizationType) else T.__members__.get(str(value).upper())
    if qtype not in MATRIX_TYPES:
        names = ", ".join(t.name for t in MATRIX_TYPES)
        raise ValueError(f"block type {value!r} is not one the tiny GGUF files write; expected one of {names}.")
    return qtype


def block_size(qtype: GGMLQuantizationType) -> int:
    """Weights per block: 32 for the legacy types, 256 for the K-quants, 1 for floats."""
    return GGML_QUANT_SIZES[qtype][0]


def weight_std(row_length: int) -> float:
    """The spread of a matrix's weights: large enough for varied greedy output, 1.6 / sqrt(row length)."""
    return 1.6 / np.sqrt(row_length)


def random_tensor(
    qtype: GGMLQuantizationType, shape: tuple[int, int], rng: np.random.Generator, name: str = "the matrix"
) -> np.ndarray:
    """A random matrix of `shape` (rows, row length) stored as `qtype`: the array GGUFWriter.add_tensor takes
    (floats for F32/F16; uint8 [rows, bytes per row] of blocks otherwise)."""
    rows, cols = shape
    std = weight_std(cols)
    if cols % block_size(qtype):
        raise ValueError(
            f"{qtype.name} stores rows of a multiple of {block_size(qtype)} weights; {name} {shape} has rows of "
            f"{cols}. Use a shape whose sizes are multiples of {block_size(qtype)} (shape_for(family, types))."
        )
    if qtype in K_QUANTS:
        n = rows * cols // block_size(qtype)
        return K_QUANT_WRITERS[qtype](n, rng, std).reshape(rows, -1)
    weights = (rng.standard_normal(shape) * std).astype(np.float32)
    return weights.astype(np.float16) if qtype == T.F16 else quantize(weights, qtype)


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a tensor stored as `qtype` reads back as (gguf's own dequantization, as transformers calls it)."""
    return dequantize(data, qtype)


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit minimums per block [n, 8] -> Q4_K/Q5_K's 12 bytes [n, 12].

    Bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the minimums; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minimums 4-7 (high
    nibble). The inverse of `gguf.quants.Q4_K.get_scale_min`.
    """
    scales, mins = scales.astype(np.uint8), mins.astype(np.uint8)
    if scales.max(initial=0) > 63 or mins.max(initial=0) > 63:
        raise ValueError("K-quant scales and minimums are 6-bit values (0..63).")
    low, high = slice(0, 4), slice(4, 8)
    first = scales[:, low] | ((scales[:, high] >> 4) << 6)
    second = mins[:, low] | ((mins[:, high] >> 4) << 6)
    third = (scales[:, high] & 0x0F) | ((mins[:, high] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def fp16_bytes(values: np.ndarray) -> np.ndarray:
    """[n] floats -> [n, 2] bytes of little-endian fp16."""
    return values.astype("<f2").view(np.uint8).reshape(len(values), 2)


def random_bytes(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    return rng.integers(0, 256, (n, size), dtype=np.uint8)


def k_scales_and_mins(n: int, rng: np.random.Generator, centre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Random 6-bit scales [n, 8], and minimums near scale·centre (a block's weights then straddle zero, as
    llama.cpp's quantizer makes them: its minimum is about half a sub-block's range), noise ±3."""
    scales = rng.integers(0, 64, (n, 8))
    mins = np.clip(np.rint(scales * centre[:, None]) + rng.integers(-3, 4, (n, 8)), 0, 63)
    return scales, mins


def q4_k_blocks(n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    # Quants 0..15, so weights d·scale·(q − 7.5) roughly: dmin·min ≈ 7.5·d·scale.
    d = rng.uniform(4.2e-3, 7.4e-3, n) * std
    dmin = d * rng.uniform(6.0, 9.0, n)
    scales, mins = k_scales_and_mins(n, rng, 7.5 * d / dmin)
    parts = [fp16_bytes(d), fp16_bytes(dmin), pack_k_scales(scales, mins), random_bytes(rng, n, 128)]
    return np.concatenate(parts, axis=1)


def q5_k_blocks(n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    # Quants 0..31: half of Q4_K's d, minimums centred at 15.5 quants.
    d = rng.uniform(2.1e-3, 3.7e-3, n) * std
    dmin = d * rng.uniform(12.0, 19.0, n)
    scales, mins = k_scales_and_mins(n, rng, 15.5 * d / dmin)
    parts = [fp16_bytes(d), fp16_bytes(dmin), pack_k_scales(scales, mins), random_bytes(rng, n, 32 + 128)]
    return np.concatenate(parts, axis=1)


def q6_k_blocks(n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    # Quants 0..63 centred at 32; signed 8-bit scales over their whole range, or a narrower one where the
    # full range would need a d below fp16's normal numbers.
    d, limit = rng.uniform(5.0e-4, 9.0e-4, n) * std, 128
    while d.min() < FP16_MIN_NORMAL and limit > 1:
        d, limit = d * 2, limit // 2
    scales = rng.integers(-limit, limit, (n, 16)).astype(np.int8).view(np.uint8)
    return np.concatenate([random_bytes(rng, n, 128 + 64), scales, fp16_bytes(d)], axis=1)


K_QUANT_WRITERS: dict[GGMLQuantizationType, Callable[[int, np.random.Generator, float], np.ndarray]] = {
    T.Q4_K: q4_k_blocks,
    T.Q5_K: q5_k_blocks,
    T.Q6_K: q6_k_blocks,
}
