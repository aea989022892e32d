"""Weight-only int4 products for the torch backend: torch's own int4 kernels on an export's 4-bit blocks.

The torch backend otherwise dequantizes a quantized weight on load and holds it in float (graphs/quantized_weights.py),
so a GGUF file's Q4_1 layers read 16 or 32 bits a weight on every token. With int4 kernels a Linear whose
weight is 4-bit holds the 4-bit values themselves, packed for `torch._weight_int4pack_mm` (CUDA: tinygemm,
compute capability 8.0 or newer) or `torch._weight_int4pack_mm_for_cpu`, and a product reads 4 bits a weight
plus two numbers per block:

    W[n, k] = (q[n, k] - 8) * s[b, n] + z[b, n]       s = scale,  z = min + scale * (8 - zero_point)

which is the stored form's affine function of q (graphs/quantized_weights.py), rewritten in the kernels' terms. The
CPU kernel computes in the export's dtype. The CUDA kernel takes bfloat16 only, so on CUDA a product's rows, s
and z are rounded to bfloat16 and its result converted back (a GGUF file's blocks export as float32 only). So
the products are close to the dequantized weights' products, not equal to them bit for bit: an export decoded
with int4 kernels is its own engine, and ParaDecode on it is compared with plain decoding on it.

ParaDecode's exactness needs a position's bits not to depend on the other rows of its call. The CUDA kernel
runs one configuration for every row count and reduces each output's K in one order (m16n8k16 tiles: rows
never mix); tests/runtime/test_int4_kernels.py checks rows alone and together on the CPU kernel, and
tests/runtime/test_gpu.py ParaDecode against plain decoding with the CUDA kernel.

Which weights: a layer's, 4-bit, a block size the kernels take (32, 64, 128, 256), whole blocks (K a multiple of
the block size and of 32), N a multiple of 8 (CUDA) or 16 (CPU). Others (a Q8_0 embedding, 8-bit blocks, the
heads' unembeddings) stay dequantized. Each shape is checked once at load against its dequantized product
(`_agrees`); a shape whose product disagrees, or that a kernel refuses, stays dequantized, with a warning, so a
kernel that packs or computes otherwise on some build is never used silently. Loading still dequantizes every
weight once (the modules are built from the float weights, then their 4-bit Linears replaced), so loading takes
the float model's memory at its peak; decoding holds and reads the 4-bit values.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from paradecode.graphs.quantized_weights import QuantizedWeight, unpack

logger = logging.getLogger(__name__)
GROUP_SIZES = (32, 64, 128, 256)  # the block sizes both kernels take
# How far the int4 product may be from the dequantized weights' product on the load check, relative to the
# product's largest value: the kernels' s and z in the activations' dtype (bfloat16: 8 bits of mantissa).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype an int4 product computes in for an export of `dtype` on `device` (module docstring)."""
    return torch.bfloat16 if device.type == "cuda" else dtype


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int4 kernels cannot run on `device` for an export of `dtype`; None where they can."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            name = torch.cuda.get_device_name(device)
            return (
                f"torch's CUDA int4 kernel needs compute capability 8.0, and {name} has {capability[0]}.{capability[1]}"
            )
        return None
    if device.type == "cpu":
        return (
            None if dtype in TOLERANCE else f"torch's CPU int4 kernel takes float32, bfloat16 or float16, not {dtype}"
        )
    return f"torch has no int4 kernel for {device.type}"


def fits(weight: QuantizedWeight, device: torch.device) -> bool:
    """Whether the kernels on `device` take this weight's blocks as they are (the CPU packer needs N a multiple of
    16, the CUDA one of 8)."""
    fmt = weight.format
    n, k = fmt.shape
    return (
        fmt.bits == 4
        and fmt.block_size in GROUP_SIZES
        and k == fmt.blocks * fmt.block_size
        and k % 32 == 0
        and n % (8 if device.type == "cuda" else 16) == 0
    )


class Int4Linear(nn.Module):
    """A Linear whose weight is read as 4-bit values by torch's int4 kernels (module docstring)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if not fits(weight, device):
            raise ValueError(f"torch's int4 kernels on {device.type} do not take a weight of {weight.format}.")
        fmt = weight.format
        self.compute = compute_dtype(device, dtype)
        self.out_features, self.in_features = fmt.shape
        self.group = fmt.block_size
        values = weight.values().reshape(self.out_features, self.in_features).to(device)  # uint8 [N, K], 0..15
        scale = weight.scales.to(device, torch.float32)
        if weight.zero_points is None:
            zero_point = torch.full_like(scale, float(1 << (fmt.bits - 1)))
        else:
            zero_point = unpack(weight.zero_points, fmt.bits)[:, : fmt.blocks].to(device, torch.float32)
        low = weight.mins.to(device, torch.float32) if weight.mins is not None else torch.zeros_like(scale)
        offset = low + scale * (8 - zero_point)
        # [blocks, N, 2], in the activations' dtype, as both kernels read them
        sz = torch.stack([scale, offset], -1).transpose(0, 1).contiguous().to(self.compute)
        self.register_buffer("scales_and_zeros", sz)
        inner = next(tiles for tiles in (8, 4, 2) if self.in_features % (16 * tiles) == 0)
        if device.type == "cuda":  # the CUDA packer reads two values a byte, the even one in the high nibble
            pairs = (values[:, ::2] << 4 | values[:, 1::2]).contiguous()
            packed = torch._convert_weight_to_int4pack(pairs, inner)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), inner)
        self.on_cuda = device.type == "cuda"
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute).contiguous()
        if self.on_cuda:
            out = torch._weight_int4pack_mm(rows, self.packed, self.group, self.scales_and_zeros)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _agrees(linear: Int4Linear, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the int4 product of a few random rows is the dequantized weight's product, to the tolerance of
    the dtype it computes in."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, linear.in_features, generator=generator).to(weight.device, dtype)
    got = linear(rows).float()
    want = torch.nn.functional.linear(
        rows.float(), weight.float(), None if linear.bias is None else linear.bias.float()
    )
    return bool((got - want).abs().max() <= TOLERANCE[linear.compute] * want.abs().max().clamp(min=1e-6))


class Int4Kernels:
    """Puts int4 products in place of a backend's modules' Linears whose weights are 4-bit (module docstring).

    `quantized`: the export's quantized weights by canonical name; `dequantized`: the canonical weights the
    modules were built from (graphs/modules.py `subgraph_state` hands these very tensors to each module). Only a
    layer's weights: a head's unembedding stays dequantized (bfloat16 logits on CUDA would tie and blur the
    probabilities exit thresholds compare). One `Int4Linear` per weight, shared by every module reading it (a
    layer graph, its segment, its fused exit graph). `finish` drops what only loading needed."""

    def __init__(self, quantized: dict[str, QuantizedWeight], dequantized: dict[str, torch.Tensor], dtype, device):
        self.dtype, self.device = dtype, torch.device(device)
        self._quantized = {
            name: w for name, w in quantized.items() if name.startswith("layers.") and fits(w, self.device)
        }
        self._by_tensor = {id(dequantized[name]): name for name in self._quantized}
        self._linears: dict[str, Int4Linear | None] = {}  # canonical name -> its module (None: stays dequantized)
        self._checked: dict[tuple, bool] = {}  # (N, K, block size) -> whether its product agreed on the load check
        self.replaced: set[str] = set()  # canonical names now read as 4-bit values

    def apply(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Replace `module`'s Linears whose state (`subgraph_state`'s tensors, by module key) is a 4-bit weight."""
        for key, tensor in state.items():
            name = self._by_tensor.get(id(tensor))
            owner, _, leaf = key.rpartition(".")
            if name is None or leaf != "weight" or not isinstance(module.get_submodule(owner), nn.Linear):
                continue
            if name not in self._linears:
                self._linears[name] = self._built(name, module.get_submodule(owner))
            if self._linears[name] is not None:
                parent, _, child = owner.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, child, self._linears[name])
                self.replaced.add(name)

    def finish(self) -> None:
        """Log what was replaced and drop the stored parts and modules kept for loading."""
        failed = len(self._quantized) - len(self.replaced)  # layer weights that fit but whose shape failed its check
        if self.replaced:
            logger.info(
                "int4 kernels read %d 4-bit weights (%d more fit but failed their shape's check); the rest stay "
                "dequantized",
                len(self.replaced),
                failed,
            )
        else:
            logger.warning(
                "int4 kernels were asked for, but no weight of this export is read by them (no quantized layer "
                "weight 4-bit in blocks the kernels take, or every shape failed its check): every weight stays "
                "dequantized. Export with --weights int4, or from a GGUF file with 4-bit blocks, to use them."
            )
        self._quantized, self._by_tensor, self._linears = {}, {}, {}

    def _built(self, name: str, linear: nn.Linear) -> Int4Linear | None:
        """`name`'s int4 module, or None where its shape's product disagrees with the dequantized one or the kernels
        refuse it (a warning says which)."""
        weight = self._quantized[name]
        shape = (*weight.format.shape, weight.format.block_size)  # mins or zero points: the same kernel inputs
        if self._checked.get(shape) is False:
            return None
        error = None
        try:
            built = Int4Linear(weight, linear.bias, self.dtype, self.device)
            agrees = self._checked[shape] = self._checked.get(shape) or _agrees(built, linear.weight, self.dtype)
        except (RuntimeError, ValueError) as err:  # a kernel that refuses a shape on this build
            built, agrees, error = None, False, err
            self._checked[shape] = False
        if not agrees:
            logger.warning(
                "torch's int4 kernel %s on %s (shape %s, blocks of %d) here: weights of that shape stay dequantized.",
                f"failed ({error})" if error else "disagrees with the dequantized weights",
                name,
                list(weight.format.shape),
                weight.format.block_size,
            )
            return None
        return built
