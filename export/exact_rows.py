"""Attention whose every row is computed the same way whatever the call's token count: exact verification.

ParaDecode verifies several positions in one call where plain decoding computes one position a call, so its
output equals plain decoding's only as far as a position's result does not depend on how many positions its
call carries (docs/design.md §3). onnxruntime's CPU GroupQueryAttention computes a one-token call with a
matrix-vector kernel (MLAS' M = 1 path) that sums in another order than the matrix kernel of a call of several
tokens: rows differ in the last bits (~1e-7). With float activations that stays a near-tie matter. With int8
activations it does not: every MatMulNBits rounds its input to 8 bits, a last-bit difference moves a value across
a rounding step now and then, and the step (1/127 of a block's largest value) grows through the layers; on
SmolLM2 ParaDecode's outputs then left plain decoding's in 15 of 18 prompts. On an AVX-512 VNNI CPU every other
operator of a layer (MatMulNBits with int8 activations, the float products, RMSNormalization, rotary embeddings)
was measured to give each row bit for bit the same result at 1, 2, 6 and 8 tokens; on AVX2 without AVX-512 the
int8 MatMulNBits computes a lone row otherwise too, which depends on the machine and so is the runtime's to
handle (runtime/row_exactness.py: a lone position then runs as two rows).

So the layer graphs of an int8-activation export give the kernel at least two query rows: a call of one row
(B = 1) appends a copy of its last token, whose keys and values go to the slot after the call's last position
and whose output is dropped. That slot is the next position's, written again (with its own values) before any
query reads it: a position's layer runs only after every earlier position's (docs/design.md §3), and a query sees
only slots up to its own. A call of several rows (B > 1: batched requests, one token each; the kernel refuses
more) is left as it is: those rows keep the one-token kernel's results, so a batch on such an export decodes each
row in calls of its own (runtime/engine.py). The runtime keeps the cache's last slot for the copy (KVCache.spare);
a call reaching the last slot (the runtime's own padding can: runtime/row_exactness.py) gets no copy, and has
several rows then. The cost: about a tenth of plain decoding's speed on SmolLM2 on
a 2-core CPU (one more attention row, a copy and two slices per layer).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from paradecode.graphs.errors import ValidationError
from paradecode.graphs.tensors import POSITIONS

GQA = "GroupQueryAttention"


def pad_attention_rows(graph: onnx.GraphProto) -> int:
    """Rewrite every GroupQueryAttention of `graph` as described above; returns how many were rewritten.

    Per attention: the tensor its queries, keys and values are split from (or each of them) gets the copied row,
    its output drops it. Whether to copy is decided from the call's positions and the fixed cache length only, so
    the layers of a segment compute the same decision from the same inputs (onnxruntime merges such nodes when it
    loads the graph): a few small nodes per layer.
    """
    producer = {out: node for node in graph.node for out in node.output}
    attentions = [node for node in graph.node if node.op_type == GQA and node.domain == "com.microsoft"]
    if not attentions:
        return 0
    first: list[onnx.NodeProto] = []  # the decisions: from the graph's inputs only
    before: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> nodes to insert before it
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for count, node in enumerate(attentions):
        prefix = f"/exact_rows/{count}"
        first += _decision(graph, node, prefix)
        if not all(node.input[:3]):
            raise ValidationError(
                f"{graph.name}: {node.name or GQA} takes packed queries, keys and values; "
                "padding it is not implemented."
            )
        split = producer.get(node.input[0])
        packed = (
            split is not None
            and split.op_type == "Split"
            and list(split.output) == list(node.input[:3])
            and _axis(split) in (-1, 2)  # split by features: the copied row goes to all three
        )
        if packed:  # one copy of the row the queries, keys and values are split from
            padded, nodes = _with_copy(split.input[0], f"{prefix}/qkv")
            before.setdefault(id(split), []).extend(nodes)
            split.input[0] = padded
            inputs = list(node.input[:3])
            _forget_shapes(graph, inputs)  # one row longer now
        else:
            inputs = []
            for name, hint in zip(node.input[:3], ("query", "key", "value")):
                padded, copy = _with_copy(name, f"{prefix}/{hint}")
                before.setdefault(id(node), []).extend(copy)
                inputs.append(padded)
        before.setdefault(id(node), []).extend(_lengths(node, prefix))
        replaced[id(node)] = _attention(node, inputs, prefix)
    nodes = list(first)
    for node in graph.node:
        nodes.extend(before.get(id(node), []))
        nodes.extend(replaced.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    return len(attentions)


def _decision(graph: onnx.GraphProto, node: onnx.NodeProto, prefix: str) -> list[onnx.NodeProto]:
    """`{prefix}/pad` (int64 [1]) = 1 where the call has one row and the cache a slot after its last position, else
    0, and `{prefix}/copy_from` = tokens - pad: from the call's positions and the cache's fixed length only."""
    slots = _shape_of(graph, node.input[3])[2]

    def const(hint: str, value: int) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.int64), f"{prefix}/{hint}"))
        return f"{prefix}/{hint}"

    one, two, zero = const("one", 1), const("two", 2), const("zero", 0)

    def n(hint: str) -> str:
        return f"{prefix}/{hint}"

    return [
        helper.make_node("Shape", [POSITIONS], [n("shape")]),
        helper.make_node("Slice", [n("shape"), zero, one], [n("rows")]),
        helper.make_node("Slice", [n("shape"), one, two], [n("tokens")]),
        helper.make_node("Equal", [n("rows"), one], [n("alone")]),
        helper.make_node("ReduceMax", [POSITIONS], [n("last")], keepdims=0),
        helper.make_node("Add", [n("last"), one], [n("end")]),
        helper.make_node("Less", [n("end"), const("slots", slots)], [n("room")]),
        helper.make_node("And", [n("alone"), n("room")], [n("padding")]),
        helper.make_node("Cast", [n("padding")], [n("pad")], to=TensorProto.INT64),
        helper.make_node("Sub", [n("tokens"), n("pad")], [n("copy_from")]),
        helper.make_node("Cast", [n("padding")], [n("pad32")], to=TensorProto.INT32),
        helper.make_node("Squeeze", [n("pad32"), zero], [n("pad32_scalar")]),
    ]


def _lengths(node: onnx.NodeProto, prefix: str) -> list[onnx.NodeProto]:
    """The kernel's lengths (`seqlens_k` [B], `total_sequence_length` scalar) counting the copy."""
    seqlens, total = node.input[5], node.input[6]
    return [
        helper.make_node("Add", [seqlens, f"{prefix}/pad32"], [f"{prefix}/seqlens"]),
        helper.make_node("Add", [total, f"{prefix}/pad32_scalar"], [f"{prefix}/total"]),
    ]


def _with_copy(name: str, prefix: str) -> tuple[str, list[onnx.NodeProto]]:
    """`name` [B, T, ...] with its last row copied after it where `pad` says so."""
    head = prefix.rsplit("/", 1)[0]
    copy, padded = f"{prefix}/copy", f"{prefix}/padded"
    return padded, [
        helper.make_node("Slice", [name, f"{head}/copy_from", f"{head}/tokens", f"{head}/one"], [copy]),
        helper.make_node("Concat", [name, copy], [padded], axis=1),
    ]


def _attention(node: onnx.NodeProto, inputs: list[str], prefix: str) -> list[onnx.NodeProto]:
    """The attention over the padded rows, and its output without the copy."""
    attention = onnx.NodeProto()
    attention.CopyFrom(node)
    del attention.input[:]
    attention.input.extend([*inputs, *node.input[3:5], f"{prefix}/seqlens", f"{prefix}/total", *node.input[7:]])
    result = node.output[0]
    attention.output[0] = f"{prefix}/output"
    return [
        attention,
        helper.make_node(
            "Slice", [f"{prefix}/output", f"{prefix}/zero", f"{prefix}/tokens", f"{prefix}/one"], [result]
        ),
    ]


def _shape_of(graph: onnx.GraphProto, name: str) -> list:
    for value in graph.input:
        if value.name == name:
            return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]
    raise ValidationError(f"{graph.name}: the attention's cache {name} is not an input of the graph")


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _forget_shapes(graph: onnx.GraphProto, names: list[str]) -> None:
    """Drop the recorded shapes of `names` (onnxruntime plans buffers by them)."""
    kept = [value for value in graph.value_info if value.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(kept)
