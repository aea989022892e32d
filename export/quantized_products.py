"""Quantized weights in the ONNX graphs: a traced graph's float MatMul and Gather rewritten to read them.

Templates are traced from float modules (export/onnx_export.py). When a graph is instantiated for a
subgraph whose weight is quantized (graphs/quantized_weights.py), the nodes that read that weight are
rewritten to read its stored parts from the export's weights file, as they are:

- `MatMul(x, W^T)` (a Linear) becomes onnxruntime's `com.microsoft.MatMulNBits(x, qweight, scales,
  zero_points)`, with `accuracy_level` 0 for float activations (the default) or 4 for int8 ones. A
  weight with minima adds their product with x's per-block sums, a small dense product:
  y = MatMulNBits(x) + blocksum(x) @ mins^T (the decomposition llama.cpp computes for Q4_1 and the
  K-quants; MatMulNBits' own float zero points would be exact too but were ~20x slower here), with
  the values centred on their midpoint (`_centred_mins`). Weights of one input and one block layout
  (a layer's q, k and v; gate and up) are one MatMulNBits (`matmul_group`). With float activations,
  8-bit weights run as two 4-bit products over their nibbles (`_eight_bits_as_nibbles`): MatMulNBits'
  float kernel for 8 bits was ~30x slower than a float MatMul, and a dense copy reads 4 bytes a weight.
- `Gather(W, ids)` (an embedding) gathers the rows' stored parts and dequantizes only them, with the
  same operations as `QuantizedWeight.dequantize`, so an embedding is exact.

Scales and minima stored as float16 are cast to float32 in the graph (folded when onnxruntime loads it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from paradecode.graphs.errors import ValidationError
from paradecode.graphs.quantization_manifest import WeightFormat
from paradecode.graphs.quantized_weights import QuantizedWeight

MS_DOMAIN = "com.microsoft"
ACCURACY_LEVEL = {"int8": 4, "float": 0}


class Rewriter:
    """Builds the nodes and constants that replace the readers of one graph's quantized weights.

    `stored(name)` gives the external initializer of a stored part (`{weight}.qweight`, ...); each is added
    to the graph once however many nodes read it.
    """

    def __init__(self, graph_name: str, stored: Callable[[str], TensorProto], activations: str):
        self.graph_name, self.stored, self.activations = graph_name, stored, activations
        self.nodes: dict[str, list[onnx.NodeProto]] = {}  # output of a replaced node -> its replacement
        self.initializers: dict[str, TensorProto] = {}
        self.counter = 0

    def _name(self, hint: str) -> str:
        self.counter += 1
        return f"/quant/{hint}_{self.counter}"

    def _part(self, weight: str, part: str) -> str:
        name = f"{weight}.{part}"
        if name not in self.initializers:
            self.initializers[name] = self.stored(name)
        return name

    def _const(self, hint: str, value: np.ndarray) -> str:
        name = self._name(hint)
        self.initializers[name] = numpy_helper.from_array(value, name)
        return name

    def _float(self, nodes: list, weight: str, part: str, fmt_dtype: str) -> str:
        """A stored float part as float32: a Cast where it is stored as float16."""
        name = self._part(weight, part)
        if fmt_dtype == "float32":
            return name
        out = self._name(f"{part}_f32")
        nodes.append(helper.make_node("Cast", [name], [out], to=TensorProto.FLOAT))
        return out

    # --- MatMul -------------------------------------------------------------------------------
    packs = True  # whether `matmul_group` may compute several weights of one input in one product

    def matmul(self, node: onnx.NodeProto, weight: str, fmt: WeightFormat) -> None:
        """Replace `MatMul(x, W^T)` [.., K] x [K, N] with its quantized form."""
        self.matmul_group([(node, weight, fmt)])

    def matmul_group(self, members: list[tuple[onnx.NodeProto, str, WeightFormat]]) -> None:
        """Replace MatMuls of one input x by weights of one block layout (a layer's q, k and v; gate and up) with
        one MatMulNBits over the weights' blocks stacked by rows, split into the members' outputs. The stacking
        is a Concat of initializers, which onnxruntime folds when it loads the graph: one product of N_q + N_k +
        N_v rows instead of three (and one correction for the minima), with no second copy kept."""
        x = members[0][0].input[0]
        outs = [node.output[0] for node, _, _ in members]
        nodes: list[onnx.NodeProto] = []
        first, fmt = members[0][1], members[0][2]
        if fmt.bits == 8 and self.activations == "float" and fmt.shape[1] % fmt.block_size:
            for node, weight, member_fmt in members:  # padded blocks: dense (only onnxruntime's int8 makes them)
                dense = self._dequantized(nodes, weight, member_fmt, transpose=True)
                nodes.append(helper.make_node("MatMul", [x, dense], list(node.output)))
            self._replace(outs, nodes)
            return
        if fmt.bits == 8 and self.activations == "float":
            self._eight_bits_as_nibbles(x, outs, members)
            return
        weights = [weight for _, weight, _ in members]
        n, k = sum(f.shape[0] for _, _, f in members), fmt.shape[1]
        scales = [self._float(nodes, w, "scales", fmt.scales) for w in weights]
        inputs = [x, self._stacked(nodes, [self._part(w, "qweight") for w in weights], "qweight")]
        inputs.append(self._stacked(nodes, scales, "scales"))
        if fmt.zero_points and fmt.mins is None:
            inputs.append(self._stacked(nodes, [self._part(w, "zero_points") for w in weights], "zero_points"))
        single = len(members) == 1
        product = outs[0] if single and fmt.mins is None else self._name("nbits")
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                inputs,
                [product],
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=fmt.bits,
                block_size=fmt.block_size,
                accuracy_level=ACCURACY_LEVEL[self.activations],
            )
        )
        if fmt.mins is not None:
            if k % fmt.block_size:
                raise ValidationError(f"{first}: minima need whole blocks (K {k}, block size {fmt.block_size}).")
            mins = self._stacked(
                nodes, [self._centred_mins(nodes, w, fmt, scale) for w, scale in zip(weights, scales)], "mins"
            )
            product = self._corrected(nodes, x, product, mins, fmt, outs[0] if single else None)
        if not single:
            sizes = self._const("split", np.array([f.shape[0] for _, _, f in members], dtype=np.int64))
            nodes.append(helper.make_node("Split", [product, sizes], outs, axis=-1))
        self._replace(outs, nodes)

    def _eight_bits_as_nibbles(self, x: str, outs: list[str], members: list) -> None:
        """8-bit weights with float activations, as two 4-bit products. onnxruntime's float kernel for 8 bits was
        ~30x slower than a float MatMul here, and a dequantized float copy reads 4 bytes a weight; its 4-bit
        float kernel is fast. With q = 16 hi + lo (hi, lo in 0..15), scale * (q - z) + min is exactly

            16 scale * (hi - 8)  +  scale * (lo - 8)  +  [8 scale + (128 - z) scale + min]

        two MatMulNBits over the weight's high and low nibbles (split and packed from the stored bytes when
        onnxruntime loads the graph) and a per-block constant, added like a block type's minima."""
        nodes: list[onnx.NodeProto] = []
        weights = [weight for _, weight, _ in members]
        fmt = members[0][2]
        n, k = sum(f.shape[0] for _, _, f in members), fmt.shape[1]
        values = self._stacked(nodes, [self._part(w, "qweight") for w in weights], "qweight")
        scales = [self._float(nodes, w, "scales", fmt.scales) for w in weights]
        high, low, high_p, low_p, scale16, hi_out, lo_out, both = (
            self._name(h) for h in ("high", "low", "high_p", "low_p", "scale16", "hi_out", "lo_out", "both")
        )
        four, mask = self._const("four", np.array(4, np.uint8)), self._const("mask", np.array(0x0F, np.uint8))
        stacked_scales = self._stacked(nodes, scales, "scales")
        nodes += [
            helper.make_node("BitShift", [values, four], [high], direction="RIGHT"),
            helper.make_node("BitwiseAnd", [values, mask], [low]),
            helper.make_node("Mul", [stacked_scales, self._const("sixteen", np.array(16.0, np.float32))], [scale16]),
        ]
        nodes += self._pack_nibbles(high, high_p) + self._pack_nibbles(low, low_p)
        common = dict(domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=fmt.block_size, accuracy_level=0)
        nodes += [
            helper.make_node("MatMulNBits", [x, high_p, scale16], [hi_out], **common),
            helper.make_node("MatMulNBits", [x, low_p, stacked_scales], [lo_out], **common),
            helper.make_node("Add", [hi_out, lo_out], [both]),
        ]
        extra = []
        for weight, scale in zip(weights, scales):
            shift = self._name("nibble_shift")
            if fmt.mins is not None:
                base = self._centred_mins(nodes, weight, fmt, scale)
            elif fmt.zero_points:
                base = self._centred_mins_without_mins(nodes, weight, fmt, scale)
            else:
                base = None
            eight = self._name("eight_scale")
            nodes.append(helper.make_node("Mul", [scale, self._const("eight", np.array(8.0, np.float32))], [eight]))
            if base is not None:
                nodes.append(helper.make_node("Add", [base, eight], [shift]))
            else:
                shift = eight
            extra.append(shift)
        product = self._corrected(
            nodes, x, both, self._stacked(nodes, extra, "mins"), fmt, outs[0] if len(outs) == 1 else None
        )
        if len(outs) > 1:
            sizes = self._const("split", np.array([f.shape[0] for _, _, f in members], dtype=np.int64))
            nodes.append(helper.make_node("Split", [product, sizes], outs, axis=-1))
        self._replace(outs, nodes)

    def _pack_nibbles(self, values: str, out: str) -> list[onnx.NodeProto]:
        """uint8 values [N, B, block] (each below 16) -> 4-bit bytes [N, B, block / 2], the even one low."""
        pairs, even, odd, even_s, odd_s, shifted = (
            self._name(h) for h in ("pairs", "even", "odd", "even_s", "odd_s", "shifted")
        )
        shape = self._const("shape", np.array([0, 0, -1, 2], dtype=np.int64))
        last = self._const("axis", np.array([-1], dtype=np.int64))
        return [
            helper.make_node("Reshape", [values, shape], [pairs]),
            helper.make_node("Split", [pairs], [even, odd], axis=-1, num_outputs=2),
            helper.make_node("Squeeze", [even, last], [even_s]),
            helper.make_node("Squeeze", [odd, last], [odd_s]),
            helper.make_node(
                "BitShift", [odd_s, self._const("four", np.array(4, np.uint8))], [shifted], direction="LEFT"
            ),
            helper.make_node("BitwiseOr", [even_s, shifted], [out]),
        ]

    def _centred_mins_without_mins(self, nodes: list, weight: str, fmt: WeightFormat, scales: str) -> str:
        """(c - z) * scale for a weight with explicit zero points and no minima (c = 2**(bits - 1))."""
        zero = self._unpacked(nodes, self._part(weight, "zero_points"), fmt.bits, rank=2)
        cut, shift, scaled = (self._name(h) for h in ("zero_cut", "shift", "shift_scaled"))
        midpoint = self._const("midpoint", np.array(float(1 << (fmt.bits - 1)), dtype=np.float32))
        nodes += [
            self._slice_last(zero, cut, fmt.blocks),
            helper.make_node("Sub", [midpoint, cut], [shift]),
            helper.make_node("Mul", [shift, scales], [scaled]),
        ]
        return scaled

    def _corrected(self, nodes: list, x: str, product: str, mins: str, fmt: WeightFormat, out: str | None) -> str:
        """product + blocksum(x) @ mins^T (mins float32 [N, B]): the per-block constants' share of x @ W^T."""
        blocked, sums, mins_t, correction = (self._name(h) for h in ("blocked", "sums", "mins_t", "correction"))
        corrected = out or self._name("corrected")
        shape = self._const("shape", np.array([0, 0, fmt.blocks, fmt.block_size], dtype=np.int64))
        axes = self._const("axes", np.array([-1], dtype=np.int64))
        nodes += [
            helper.make_node("Reshape", [x, shape], [blocked]),
            helper.make_node("ReduceSum", [blocked, axes], [sums], keepdims=0),
            helper.make_node("Transpose", [mins], [mins_t], perm=[1, 0]),
            helper.make_node("MatMul", [sums, mins_t], [correction]),
            helper.make_node("Add", [product, correction], [corrected]),
        ]
        return corrected

    def _stacked(self, nodes: list, parts: list[str], hint: str) -> str:
        """The tensors `parts` stacked along their first axis (rows); the one tensor itself when alone."""
        if len(parts) == 1:
            return parts[0]
        out = self._name(f"{hint}_stacked")
        nodes.append(helper.make_node("Concat", parts, [out], axis=0))
        return out

    def _replace(self, outs: list[str], nodes: list[onnx.NodeProto]) -> None:
        """The replacement of the nodes producing `outs`: all of it where the first stood, nothing for the rest."""
        self.nodes[outs[0]] = nodes
        for out in outs[1:]:
            self.nodes[out] = []

    def _centred_mins(self, nodes: list, weight: str, fmt: WeightFormat, scales: str) -> str:
        """The minima for values centred on the midpoint c = 2**(bits - 1): scale * (q - z) + min equals
        scale * (q - c) + (min + (c - z) * scale), float32 [N, B].

        A weight with minima multiplies values q - c that lie around zero (GGUF's values are stored so), not
        the uncentred q - z: with int8 activations, MatMulNBits' rounding error is then a share of the centred
        product rather than of two large terms that cancel (measured on SmolLM2's Q4_1 layers: 5-7% of a
        layer's output uncentred). Computed from initializers only, so onnxruntime folds it when it loads."""
        mins = self._float(nodes, weight, "mins", fmt.mins)
        if not fmt.zero_points:
            return mins
        zero = self._unpacked(nodes, self._part(weight, "zero_points"), fmt.bits, rank=2)
        cut, shift, scaled, centred = (self._name(h) for h in ("zero_cut", "shift", "shift_scaled", "mins_c"))
        midpoint = self._const("midpoint", np.array(float(1 << (fmt.bits - 1)), dtype=np.float32))
        nodes += [
            self._slice_last(zero, cut, fmt.blocks),
            helper.make_node("Sub", [midpoint, cut], [shift]),
            helper.make_node("Mul", [shift, scales], [scaled]),
            helper.make_node("Add", [mins, scaled], [centred]),
        ]
        return centred

    def _dequantized(self, nodes: list, weight: str, fmt: WeightFormat, *, transpose: bool) -> str:
        """The whole weight dequantized in the graph: float32 [N, K], or [K, N] with `transpose`."""
        values = self._name("values")
        nodes.append(helper.make_node("Cast", [self._part(weight, "qweight")], [values], to=TensorProto.FLOAT))
        dense = self._affine(nodes, weight, fmt, values, gathered=None)
        flat, cut = self._name("flat"), self._name("dense")
        n, k = fmt.shape
        nodes.append(
            helper.make_node("Reshape", [dense, self._const("shape", np.array([n, -1], dtype=np.int64))], [flat])
        )
        nodes.append(self._slice_last(flat, cut, k))
        if not transpose:
            return cut
        out = self._name("dense_t")
        nodes.append(helper.make_node("Transpose", [cut], [out], perm=[1, 0]))
        return out

    # --- Gather -------------------------------------------------------------------------------
    def gather(self, node: onnx.NodeProto, weight: str, fmt: WeightFormat) -> None:
        """Replace `Gather(W, ids)` (axis 0) with a gather of the rows' stored parts, dequantized."""
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis != 0:
            raise ValidationError(f"{weight}: a Gather on axis {axis} cannot read a quantized weight (rows only).")
        ids, (out,) = node.input[1], node.output
        nodes: list[onnx.NodeProto] = []
        raw = self._name("rows")
        nodes.append(helper.make_node("Gather", [self._part(weight, "qweight"), ids], [raw], axis=0))
        values = self._unpacked(nodes, raw, fmt.bits, rank=4)  # ids [b, t] -> [b, t, B, block] float32
        dense = self._affine(nodes, weight, fmt, values, gathered=ids)
        flat = self._name("flat")
        shape = self._const("shape", np.array([0, 0, -1], dtype=np.int64))
        nodes.append(helper.make_node("Reshape", [dense, shape], [flat]))
        nodes.append(self._slice_last(flat, out, fmt.shape[1]))
        self.nodes[out] = nodes

    def _unpacked(self, nodes: list, packed: str, bits: int, rank: int) -> str:
        """uint8 bytes [.., m] (of rank `rank`) -> float32 values [.., m * 8 / bits] (4-bit: low nibble first)."""
        out = self._name("values")
        if bits == 8:
            nodes.append(helper.make_node("Cast", [packed], [out], to=TensorProto.FLOAT))
            return out
        low, high, low_u, high_u, pair, merged = (
            self._name(h) for h in ("low", "high", "low_u", "high_u", "pair", "merged")
        )
        last = self._const("axis", np.array([-1], dtype=np.int64))
        shape = self._const("shape", np.array([0] * (rank - 1) + [-1], dtype=np.int64))  # [.., m, 2] -> [.., 2m]
        mask, four = self._const("mask", np.array(0x0F, dtype=np.uint8)), self._const("four", np.array(4, np.uint8))
        nodes += [
            helper.make_node("BitwiseAnd", [packed, mask], [low]),
            helper.make_node("BitShift", [packed, four], [high], direction="RIGHT"),
            helper.make_node("Unsqueeze", [low, last], [low_u]),
            helper.make_node("Unsqueeze", [high, last], [high_u]),
            helper.make_node("Concat", [low_u, high_u], [pair], axis=-1),
            helper.make_node("Reshape", [pair, shape], [merged]),
            helper.make_node("Cast", [merged], [out], to=TensorProto.FLOAT),
        ]
        return out

    def _affine(self, nodes: list, weight: str, fmt: WeightFormat, values: str, gathered: str | None) -> str:
        """scale * (values - zero point) (+ min), per block: values [.., B, block] float32 -> [.., B, block].

        `gathered`: the ids whose rows `values` holds (an embedding), None for the whole weight."""

        def per_block(part: str, dtype: str | None) -> str:
            name = self._part(weight, part)
            if gathered is not None:
                rows = self._name(f"{part}_rows")
                nodes.append(helper.make_node("Gather", [name, gathered], [rows], axis=0))
                name = rows
            if part == "zero_points":
                unpacked = self._unpacked(nodes, name, fmt.bits, rank=2 if gathered is None else 3)  # [.., B' >= B]
                cut = self._name("zero_points_cut")
                nodes.append(self._slice_last(unpacked, cut, fmt.blocks))
                name = cut
            elif dtype == "float16":
                cast = self._name(f"{part}_f32")
                nodes.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT))
                name = cast
            expanded, last = self._name(f"{part}_b"), self._const("axis", np.array([-1], np.int64))
            nodes.append(helper.make_node("Unsqueeze", [name, last], [expanded]))
            return expanded

        if fmt.zero_points:
            zero = per_block("zero_points", None)
        else:
            zero = self._const("zero", np.array(float(1 << (fmt.bits - 1)), dtype=np.float32))
        centred, scaled = self._name("centred"), self._name("scaled")
        nodes += [
            helper.make_node("Sub", [values, zero], [centred]),
            helper.make_node("Mul", [per_block("scales", fmt.scales), centred], [scaled]),
        ]
        if fmt.mins is None:
            return scaled
        shifted = self._name("shifted")
        nodes.append(helper.make_node("Add", [scaled, per_block("mins", fmt.mins)], [shifted]))
        return shifted

    def _slice_last(self, x: str, out: str, length: int) -> onnx.NodeProto:
        """x[..., :length] (a no-op where it is that long already: blocks padded past K are cut)."""
        starts = self._const("starts", np.array([0], dtype=np.int64))
        ends = self._const("ends", np.array([length], dtype=np.int64))
        axes = self._const("axes", np.array([-1], dtype=np.int64))
        return helper.make_node("Slice", [x, starts, ends, axes], [out])


def rewrite(
    graph: onnx.GraphProto,
    readers: Mapping[str, tuple[str, bool, WeightFormat]],
    stored: Callable[[str], TensorProto],
    activations: str,
    tensorrt: Mapping[str, QuantizedWeight] | None = None,
) -> None:
    """Rewrite every node of `graph` that reads one of `readers` (initializer name -> (canonical weight,
    transposed, format)) to read the quantized weight instead. Fails on a reader it cannot rewrite.

    With `tensorrt` (the quantized weights themselves), the graph is the variant TensorRT builds its engine
    from instead (export/quantized_products_tensorrt.py)."""
    if tensorrt is None:
        rewriter = Rewriter(graph.name, stored, activations)
    else:
        from paradecode.export.quantized_products_tensorrt import TensorRTRewriter

        rewriter = TensorRTRewriter(graph.name, stored, activations, tensorrt)
    groups: dict[tuple, list] = {}  # MatMuls of one input and one block layout: computed in one product
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name not in readers:
                continue
            weight, transposed, fmt = readers[name]
            if node.op_type == "MatMul" and position == 1 and transposed:
                layout = (fmt.bits, fmt.block_size, fmt.shape[1], fmt.scales, fmt.zero_points, fmt.mins)
                key = (node.input[0], layout) if rewriter.packs else (node.output[0],)
                groups.setdefault(key, []).append((node, weight, fmt))
            elif node.op_type == "Gather" and position == 0 and not transposed:
                rewriter.gather(node, weight, fmt)
            else:
                raise ValidationError(
                    f"{graph.name}: the quantized weight {weight} is read by {node.op_type} (input {position}"
                    f"{', transposed' if transposed else ''}); only a Linear's MatMul and an embedding's Gather "
                    "can read a quantized weight."
                )
    for members in groups.values():
        rewriter.matmul_group(members)
    nodes = []
    for node in graph.node:
        replacement = rewriter.nodes.get(node.output[0]) if node.output else None
        nodes.extend(replacement if replacement is not None else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(rewriter.initializers.values())
