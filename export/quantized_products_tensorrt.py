"""The variant of a quantized graph that TensorRT builds an engine from (`--engine tensorrt`).

TensorRT reads neither onnxruntime's `MatMulNBits` nor the bit operations of the exact embedding. Its
documented weight-only quantization is a `DequantizeLinear` of a constant INT4 or INT8 weight, symmetric
(no zero point) and blocked along K, feeding a MatMul. So each quantized Linear is written as

    y = x @ DequantizeLinear(q - c, scale)^T  +  blocksum(x) @ (min + (c - zero point) * scale)^T

with c the midpoint 2**(bits - 1) (the values centred, signed: INT4 in -8..7, INT8 in -128..127) and the
second product only where the weight has minima or zero points. An embedding is a Gather of the table
dequantized when the variant is written (TensorRT holds it in float). The variant is written beside the
graphs for the build and removed after it; the engines hold their own weights.

Written against TensorRT's documentation ("Working with Quantized Types": INT4 weight-only, block
quantization) and never run here: this machine has no TensorRT and no GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from paradecode.export.quantized_products import Rewriter
from paradecode.graphs.errors import ValidationError
from paradecode.graphs.quantization_manifest import WeightFormat
from paradecode.graphs.quantized_weights import QuantizedWeight, unpack


def signed_values(weight: QuantizedWeight) -> np.ndarray:
    """q - c as int8 [N, B * block_size] (c the midpoint: -8..7 for 4 bits, -128..127 for 8)."""
    fmt = weight.format
    values = weight.values().to(torch.int16) - (1 << (fmt.bits - 1))
    return values.reshape(fmt.shape[0], -1).to(torch.int8).numpy()


def int4_tensor(name: str, values: np.ndarray) -> TensorProto:
    """An ONNX INT4 tensor: two values to a byte, the first in the low four bits (two's complement)."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return helper.make_tensor(name, TensorProto.INT4, list(values.shape), packed.tobytes(), raw=True)


class TensorRTRewriter(Rewriter):
    packs = False  # one DequantizeLinear + MatMul per weight

    def matmul_group(self, members: list[tuple[onnx.NodeProto, str, WeightFormat]]) -> None:
        for node, weight, fmt in members:
            self.matmul(node, weight, fmt)

    def __init__(
        self,
        graph_name: str,
        stored: Callable[[str], TensorProto],
        activations: str,
        weights: Mapping[str, QuantizedWeight],
    ):
        super().__init__(graph_name, stored, activations)
        self.weights = weights

    def matmul(self, node: onnx.NodeProto, weight: str, fmt: WeightFormat) -> None:
        x, (out,) = node.input[0], node.output
        quantized = self.weights[weight]
        values = signed_values(quantized)
        q_name = self._name("weight_q")
        if fmt.bits == 4:
            self.initializers[q_name] = int4_tensor(q_name, values)
        else:
            self.initializers[q_name] = numpy_helper.from_array(values, q_name)
        scales = self._const("scales", quantized.scales.to(torch.float32).numpy())
        dense, cut, dense_t = self._name("dense"), self._name("dense_k"), self._name("dense_t")
        product = out if not (fmt.zero_points or fmt.mins) else self._name("product")
        nodes = [
            helper.make_node("DequantizeLinear", [q_name, scales], [dense], axis=1, block_size=fmt.block_size),
            self._slice_last(dense, cut, fmt.shape[1]),
            helper.make_node("Transpose", [cut], [dense_t], perm=[1, 0]),
            helper.make_node("MatMul", [x, dense_t], [product]),
        ]
        if product != out:
            nodes += self._correction(x, product, out, weight, quantized)
        self.nodes[out] = nodes

    def _correction(self, x: str, product: str, out: str, weight: str, quantized: QuantizedWeight) -> list:
        """+ blocksum(x) @ (min + (c - zero point) * scale)^T, the part the symmetric INT4/INT8 form leaves."""
        fmt = quantized.format
        if fmt.shape[1] % fmt.block_size:
            raise ValidationError(
                f"{weight}: TensorRT's form of a weight with zero points or minima needs whole blocks "
                f"(K {fmt.shape[1]}, block size {fmt.block_size})."
            )
        scales = quantized.scales.to(torch.float32)
        shift = torch.zeros_like(scales)
        if quantized.zero_points is not None:
            zero = unpack(quantized.zero_points, fmt.bits)[:, : fmt.blocks].to(torch.float32)
            shift = ((1 << (fmt.bits - 1)) - zero) * scales
        if quantized.mins is not None:
            shift = shift + quantized.mins.to(torch.float32)
        mins_t = self._const("correction_t", shift.t().contiguous().numpy())
        shape = self._const("shape", np.array([0, 0, fmt.blocks, fmt.block_size], dtype=np.int64))
        axes = self._const("axes", np.array([-1], dtype=np.int64))
        blocked, sums, correction = self._name("blocked"), self._name("sums"), self._name("correction")
        return [
            helper.make_node("Reshape", [x, shape], [blocked]),
            helper.make_node("ReduceSum", [blocked, axes], [sums], keepdims=0),
            helper.make_node("MatMul", [sums, mins_t], [correction]),
            helper.make_node("Add", [product, correction], [out]),
        ]

    def gather(self, node: onnx.NodeProto, weight: str, fmt: WeightFormat) -> None:
        table = self._const("table", self.weights[weight].dequantize().numpy())
        self.nodes[node.output[0]] = [helper.make_node("Gather", [table, node.input[1]], list(node.output), axis=0)]
