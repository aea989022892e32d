"""A GGUF tensor's own blocks, repacked exactly into the blockwise form of `graphs.quantized_weights`.

Each supported block type is decoded into integers q, a scale and a minimum per block, such that
`scale * (q - zero point) + min` is, operation for operation, what `gguf.quants.dequantize` computes
(tests/export/test_gguf_blocks.py checks every type bit for bit). How each type maps:

    type   block  stored values            zero point      scale            min
    Q4_0   32     q (4-bit)                8 (default)     d (fp16)         -
    Q4_1   32     q (4-bit)                0               d (fp16)         m (fp16)
    Q5_0   32     q + 112 (8-bit)          128 (default)   d (fp16)         -
    Q5_1   32     q + 112 (8-bit)          112             d (fp16)         m (fp16)
    Q8_0   32     q + 128 (8-bit)          128 (default)   d (fp16)         -
    Q4_K   32     q (4-bit)                0               d * sc (fp32)    -(dmin * m) (fp32)
    Q5_K   32     q + 112 (8-bit)          112             d * sc (fp32)    -(dmin * m) (fp32)
    Q6_K   16     q + 96 (8-bit)           128 (default)   d * sc (fp32)    -

5- and 6-bit values are stored in 8 bits (onnxruntime's MatMulNBits reads 4 or 8), shifted so that
they lie around the 8-bit midpoint 128 (the graphs compute with values centred there: see
export/quantized_products.py). Scales that are a product of two stored numbers are exact in float32 (an fp16
times a 6- or 8-bit integer); the K-quants' minima are too. Other types are not kept: Q2_K and Q3_K
(not done yet: 2/3-bit values with 16-value sub-blocks), the IQ types (codebooks) and the TQ types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from paradecode.graphs.quantization_manifest import WeightFormat
from paradecode.graphs.quantized_weights import QuantizedWeight, pack


@dataclass(frozen=True)
class Decoded:
    """A run of GGUF blocks decoded: values uint8 [n, sub, block], scales and minima [n, sub]."""

    values: np.ndarray
    bits: int
    scales: np.ndarray  # float16 or float32
    zero_point: int | None  # an explicit zero point (the same for every block); None: the default 2**(bits - 1)
    mins: np.ndarray | None = None


DECODERS: dict[str, Callable[[np.ndarray], Decoded]] = {}


def decoder(name: str):
    """Register the decoder of the GGUF block type `name` (a `gguf.GGMLQuantizationType` name)."""

    def register(fn: Callable[[np.ndarray], Decoded]) -> Callable[[np.ndarray], Decoded]:
        DECODERS[name] = fn
        return fn

    return register


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields [n, 2] -> float16 [n]."""
    return np.ascontiguousarray(raw).view(np.float16)[:, 0]


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., m] -> [..., 2m]: the m low nibbles, then the m high nibbles (ggml's order)."""
    return np.concatenate([raw & 0x0F, raw >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits, a little-endian uint32 per block [n, 4] -> [n, 32] of 0/1."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


@decoder("Q4_0")
def _q4_0(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 2:18])[:, None], 4, _f16(blocks[:, 0:2])[:, None], None)


@decoder("Q4_1")
def _q4_1(blocks: np.ndarray) -> Decoded:
    return Decoded(
        _nibbles(blocks[:, 4:20])[:, None], 4, _f16(blocks[:, 0:2])[:, None], 0, _f16(blocks[:, 2:4])[:, None]
    )


@decoder("Q5_0")
def _q5_0(blocks: np.ndarray) -> Decoded:
    q = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6]) << 4)
    return Decoded((q + 112)[:, None], 8, _f16(blocks[:, 0:2])[:, None], None)


@decoder("Q5_1")
def _q5_1(blocks: np.ndarray) -> Decoded:
    q = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8]) << 4)
    return Decoded((q + 112)[:, None], 8, _f16(blocks[:, 0:2])[:, None], 112, _f16(blocks[:, 2:4])[:, None])


@decoder("Q8_0")
def _q8_0(blocks: np.ndarray) -> Decoded:
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.int16) + 128
    return Decoded(q.astype(np.uint8)[:, None], 8, _f16(blocks[:, 0:2])[:, None], None)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 sub-block scales d * sc and minima -(dmin * m), float32 [n, 8]."""
    from gguf.quants import Q4_K

    d = _f16(blocks[:, 0:2]).astype(np.float32)[:, None]
    dmin = _f16(blocks[:, 2:4]).astype(np.float32)[:, None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes of low bits -> [n, 8, 32]: sub-block 2i + h is nibble h of 32-byte group i."""
    groups = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(len(qs), 8, 32)


@decoder("Q4_K")
def _q4_k(blocks: np.ndarray) -> Decoded:
    scales, mins = _k_scales(blocks)
    return Decoded(_k_low_nibbles(blocks[:, 16:144]), 4, scales, 0, mins)


@decoder("Q5_K")
def _q5_k(blocks: np.ndarray) -> Decoded:
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(len(blocks), 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(blocks[:, 48:176]) | ((qh & 1) << 4)
    return Decoded(q + 112, 8, scales, 112, mins)


@decoder("Q6_K")
def _q6_k(blocks: np.ndarray) -> Decoded:
    n = len(blocks)
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)) + 96).reshape(n, 16, 16)  # q6 - 32 = (q6 + 96) - 128
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210]).astype(np.float32)[:, None]
    return Decoded(q.astype(np.uint8), 8, d * sc, None)


def supported(type_name: str) -> bool:
    return type_name in DECODERS


def quantized_from_gguf(data: np.ndarray, type_name: str, row_length: int) -> QuantizedWeight:
    """The rows of a GGUF tensor (its raw bytes, uint8 [N, bytes per row]; N rows of `row_length` values,
    ne[1] x ne[0] in GGUF's terms) as a `QuantizedWeight` holding the very same numbers."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elements, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows = data.shape[0]
    if data.ndim != 2 or row_length % elements or data.shape[1] != row_length // elements * type_size:
        raise ValueError(
            f"a {type_name} tensor of rows of {row_length} values holds {row_length // elements * type_size} "
            f"bytes a row; got bytes of shape {list(data.shape)}."
        )
    decoded = DECODERS[type_name](data.reshape(-1, type_size))
    block = decoded.values.shape[-1]
    blocks = row_length // block
    values = torch.from_numpy(np.ascontiguousarray(decoded.values)).reshape(rows, blocks, block)
    scales = torch.from_numpy(np.ascontiguousarray(decoded.scales)).reshape(rows, blocks)
    mins = None if decoded.mins is None else torch.from_numpy(np.ascontiguousarray(decoded.mins)).reshape(rows, blocks)
    fmt = WeightFormat(
        source=type_name,
        bits=decoded.bits,
        block_size=block,
        shape=(rows, row_length),
        scales=str(scales.dtype).removeprefix("torch."),
        zero_points=decoded.zero_point is not None,
        mins=None if mins is None else str(mins.dtype).removeprefix("torch."),
    )
    zero_points = None
    if decoded.zero_point is not None:
        blocks_shape = (rows, fmt.blocks + (fmt.blocks % 2 if decoded.bits == 4 else 0))
        zero_points = pack(torch.full(blocks_shape, decoded.zero_point, dtype=torch.uint8), decoded.bits)
    return QuantizedWeight(fmt, pack(values, decoded.bits), scales, zero_points, mins)
