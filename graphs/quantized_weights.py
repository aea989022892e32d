"""Quantized weights: one blockwise form for a GGUF file's own blocks and for onnxruntime's quantizer.

A quantized weight W [N, K] (a Linear weight, output rows by input columns, or an embedding table,
tokens by hidden) is split along K into blocks of `block_size` values; block b of row n holds
integers q in 0 .. 2**bits - 1 and

    W[n, k] = scale[n, b] * (q[n, k] - zero_point[n, b]) + min[n, b]        (b = k // block_size)

with `zero_point` 2**(bits - 1) where none is stored and `min` 0 where none is stored. Every
GGUF block type whose values are an affine function of integers maps onto this exactly (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: export/gguf_blocks.py), and so does onnxruntime's
`MatMulNBits` quantization (`--weights int4/int8`), which has no minimum.

Stored tensors (in the export's weights file, under the weight's canonical name plus a suffix), laid
out as onnxruntime's `com.microsoft.MatMulNBits` reads them, so its graphs point at them as they are:

    {name}.qweight      uint8 [N, B, block_size * bits / 8]   (B = ceil(K / block_size); 4-bit values
                                                              two to a byte, the even one in the low nibble)
    {name}.scales       float16 or float32 [N, B]
    {name}.zero_points  uint8 [N, ceil(B * bits / 8)]         (optional; 4-bit: two blocks to a byte)
    {name}.mins         float16 or float32 [N, B]             (optional)

`dequantize` computes W in float32 with exactly the operations GGUF's reference dequantization uses
(one product, then one sum), so a GGUF weight dequantizes bit for bit to what `gguf` gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradecode.graphs.errors import ManifestError
from paradecode.graphs.quantization_manifest import PARTS, Quantization, WeightFormat


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bytes [..., n] -> the uint8 values they hold [..., n * 8 / bits] (4-bit: low nibble first)."""
    if bits == 8:
        return packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack`: uint8 values [..., n] (n even for 4 bits) -> bytes [..., n * bits / 8]."""
    values = values.to(torch.uint8)
    if bits == 8:
        return values.contiguous()
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in the blockwise form above: its format and its stored tensors."""

    format: WeightFormat
    qweight: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for part, (shape, dtype) in self.format.stored_shapes().items():
            tensor = getattr(self, part)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != getattr(torch, dtype):
                got = "absent" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
                raise ValueError(f"quantized part {part} is {got}; its format says {dtype} {list(shape)}.")
        for part in ("zero_points", "mins"):
            if part not in self.format.stored_shapes() and getattr(self, part) is not None:
                raise ValueError(f"quantized part {part} is given, but its format has none.")

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored tensors by suffix."""
        return {part: getattr(self, part) for part in PARTS if getattr(self, part) is not None}

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The stored tensors under their names in the weights file."""
        return {f"{name}.{part}": tensor for part, tensor in self.parts().items()}

    @classmethod
    def from_stored(cls, name: str, fmt: WeightFormat, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The weight `name` read back from a weights file's tensors; errors name what is missing or wrong."""
        missing = [f"{name}.{part}" for part in fmt.stored_shapes() if f"{name}.{part}" not in tensors]
        if missing:
            raise ManifestError(f"the weights file lacks {missing}, which the manifest's format of {name} needs.")
        try:
            return cls(fmt, **{part: tensors[f"{name}.{part}"] for part in fmt.stored_shapes()})
        except ValueError as err:
            raise ManifestError(f"{name} in the weights file does not fit its recorded format: {err}") from err

    def values(self) -> torch.Tensor:
        """The integer values q, uint8 [N, B, block_size]."""
        return unpack(self.qweight, self.format.bits)

    def dequantize(self) -> torch.Tensor:
        """W in float32 [N, K]: scale * (q - zero point), then + min (GGUF's own order of operations)."""
        fmt = self.format
        n, k = fmt.shape
        q = self.values().to(torch.float32)
        if self.zero_points is None:
            zero = torch.tensor(float(1 << (fmt.bits - 1)))
        else:
            zero = unpack(self.zero_points, fmt.bits)[:, : fmt.blocks].to(torch.float32)[..., None]
        weight = self.scales.to(torch.float32)[..., None] * (q - zero)
        if self.mins is not None:
            weight = weight + self.mins.to(torch.float32)[..., None]
        return weight.reshape(n, fmt.blocks * fmt.block_size)[:, :k].contiguous()

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the rows `index` only (an exit head's reduced vocabulary), blocks untouched."""
        fmt = self.format
        shape = (len(index), fmt.shape[1])
        picked = {part: tensor[index].contiguous() for part, tensor in self.parts().items()}
        return QuantizedWeight(WeightFormat(**{**fmt.__dict__, "shape": shape}), **picked)


def dequantized(tensors: dict[str, torch.Tensor], quantization: Quantization | None) -> dict[str, torch.Tensor]:
    """A weights file's tensors with every quantized weight's stored parts replaced by the float32 weight
    they hold (the torch backend's reference form)."""
    if quantization is None:
        return tensors
    out = dict(tensors)
    for name, fmt in quantization.weights.items():
        weight = QuantizedWeight.from_stored(name, fmt, tensors)
        for key in weight.stored(name):
            del out[key]
        out[name] = weight.dequantize()
    return out
