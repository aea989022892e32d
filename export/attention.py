"""The exported attention: each `paradecode::CacheAttention` placeholder (`graphs.ops.exported_attention`) expanded
into standard ONNX operators.

One form for every call, whatever its rows and positions, and every backend reads it: rotary embeddings
(onnxruntime's RotaryEmbedding operator, or elementwise operators for TensorRT), the new keys and values written
into the cache in place (TensorScatter), then per key/value head one product of its queries with the whole cache
it is given, an additive mask, a softmax and one product with the values:

    q [B, T, H*D]  ->  [B, H_kv, G*T, D]          (G = H / H_kv query heads per key/value head, rows g*T + t;
                                                   with G = 1, each query twice, so that no product has one row)
    scores = q · keys^T · scale + bias             [B, H_kv, G*T, S]   (bias 0 where slot s is visible, else -inf)
    out = softmax(scores) · values                 [B, H_kv, G*T, D]  ->  [B, T, H*D]

A slot is visible to the query at position p where s <= p, and p - s < window for a sliding window. So a row's
result does not depend on the other rows and positions of its call, nor on how many slots the cache has past the
ones it sees (masked slots add exact zeros), as onnxruntime's standard MatMul and Softmax compute it: no copy of a
lone row, no kernel that refuses several rows of several positions (onnxruntime's GroupQueryAttention did both).
Whether a machine's kernels keep that is the runtime's row probe's to check (runtime/row_exactness.py).

What depends only on the call's positions and the cache's length (the write index, the mask per window, the
positions' rows of the rotary tables) is named under `SHARED`, computed once per graph: a segment composed of layer
graphs keeps the first layer's (export/segments.py), so its layers share one mask. Every cache a graph reads has
the same number of slots (the runtime allocates a sequence's caches together).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from paradecode.graphs.errors import ValidationError
from paradecode.graphs.ops import ATTENTION_DOMAIN, ATTENTION_OP
from paradecode.graphs.tensors import POSITIONS

SHARED = "/shared/attention/"  # names of what every attention of a graph (and of a segment's layers) shares


def expand_attention(graph: onnx.GraphProto) -> int:
    """Replace every CacheAttention placeholder of `graph` with standard operators (above); how many there were."""
    placeholders = [n for n in graph.node if n.domain == ATTENTION_DOMAIN and n.op_type == ATTENTION_OP]
    if not placeholders:
        return 0
    shared = _Builder(SHARED)
    replaced = {}
    for count, node in enumerate(placeholders):
        own = _Builder(f"/attention/{count}/")
        _expand(node, own, shared)
        replaced[id(node)] = own.nodes
        graph.initializer.extend(own.initializers.values())
    nodes = list(shared.nodes)  # they read graph inputs and constants only: first
    for node in graph.node:
        nodes.extend(replaced.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(shared.initializers.values())
    return len(placeholders)


class _Builder:
    """Nodes and constants under one name prefix; a name made twice (a shared one) is made once."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, TensorProto] = {}
        self.made: set[str] = set()

    def name(self, hint: str) -> str:
        return self.prefix + hint

    def const(self, hint: str, value) -> str:
        name = self.name(hint)
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def scalar(self, hint: str, value: float, dtype: int) -> str:
        """A scalar of the graph's float `dtype` (an ONNX TensorProto type: bfloat16 has no numpy type)."""
        name = self.name(hint)
        if name not in self.initializers:
            value = np.array(value, helper.tensor_dtype_to_np_dtype(dtype))  # ml_dtypes' bfloat16 where it is
            self.initializers[name] = numpy_helper.from_array(value, name)
        return name

    def node(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        """One node with one output, `hint`'s name; nothing new where that output is made already."""
        out = self.name(hint)
        if out not in self.made:
            self.made.add(out)
            self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _expand(node: onnx.NodeProto, own: _Builder, shared: _Builder) -> None:
    q, k, v, past_key, past_value = node.input[:5]
    cos, sin = (node.input[6], node.input[7]) if len(node.input) > 7 else ("", "")
    out, present_key, present_value = node.output
    a = _attrs(node)
    heads, kv_heads, dim = a["num_heads"], a["kv_num_heads"], a["head_dim"]
    window, rotary_dim, rotary_op, dtype = a["window"], a["rotary_dim"], a["rotary_op"], a["dtype"]
    table = a.get("rotary_table", b"rope")
    table = table.decode() if isinstance(table, bytes) else table
    if heads % kv_heads:
        raise ValidationError(f"{node.name}: {heads} query heads do not group over {kv_heads} key/value heads.")
    if rotary_dim and (not cos or not sin):
        raise ValidationError(f"{node.name}: rotary embeddings need the cos and sin tables as inputs 6 and 7.")
    group = heads // kv_heads

    # rotary embeddings on q and k [B, T, heads*D]
    if rotary_dim:
        rotate = _rotary_op if rotary_op else _rotary_elementwise
        q = rotate(own, shared, q, (cos, sin, table), heads, dim, rotary_dim, "q")
        k = rotate(own, shared, k, (cos, sin, table), kv_heads, dim, rotary_dim, "k")

    # the new keys and values into the cache, in place: [B, T, H_kv*D] -> [B, H_kv, T, D] at positions[:, 0]
    first = shared.node("Gather", [POSITIONS, shared.const("zero", np.array(0, np.int64))], "write_index", axis=1)
    heads_shape = own.const("kv_shape", np.array([0, 0, kv_heads, dim], np.int64))
    for x, cache, result, hint in ((k, past_key, present_key, "k"), (v, past_value, present_value, "v")):
        split = own.node("Reshape", [x, heads_shape], f"{hint}_heads")
        moved = own.node("Transpose", [split], f"{hint}_moved", perm=[0, 2, 1, 3])
        own.nodes.append(
            helper.make_node("TensorScatter", [cache, moved, first], [result], name=own.name(f"{hint}_write"), axis=2)
        )

    # queries as [B, H_kv, G*T, D], rows g*T + t. With one query head per key/value head, each query twice (as if G
    # were 2): a lone position would otherwise be a product of one row, which onnxruntime's CPU kernels compute
    # otherwise than a row among others.
    rows_per_head = max(group, 2)
    q5 = own.node("Reshape", [q, own.const("q_shape", np.array([0, 0, kv_heads, group, dim], np.int64))], "q_heads")
    if group == 1:
        twice = own.const("twice", np.array([1, 1, 1, 2, 1], np.int64))
        q5 = own.node("Tile", [q5, twice], "q_twice")
    moved = own.node("Transpose", [q5], "q_moved", perm=[0, 2, 3, 1, 4])
    rows = own.node("Reshape", [moved, own.const("rows_shape", np.array([0, kv_heads, -1, dim], np.int64))], "q_rows")

    keys_t = own.node("Transpose", [present_key], "keys_t", perm=[0, 1, 3, 2])
    scores = own.node("MatMul", [rows, keys_t], "scores")
    scaled = own.node("Mul", [scores, own.scalar("scale", a["scale"], dtype)], "scaled")
    masked = own.node("Add", [scaled, _bias(shared, past_key, window, rows_per_head, dtype)], "masked")
    if dtype != TensorProto.FLOAT:  # softmax in float32, as the PyTorch modules (and transformers) compute it
        masked = own.node("Cast", [masked], "masked_f32", to=TensorProto.FLOAT)
        probs = own.node("Cast", [own.node("Softmax", [masked], "probs_f32", axis=-1)], "probs", to=dtype)
    else:
        probs = own.node("Softmax", [masked], "probs", axis=-1)
    context = own.node("MatMul", [probs, present_value], "context")  # [B, H_kv, G*T, D]

    # back to [B, T, H*D] (with one query head per key/value head, the first of its two copies)
    shape = own.const("context_shape", np.array([0, kv_heads, rows_per_head, -1, dim], np.int64))
    split = own.node("Reshape", [context, shape], "split")
    if group == 1:
        first = [own.const(n, np.array([v], np.int64)) for n, v in (("from_0", 0), ("to_1", 1), ("axis_2", 2))]
        split = own.node("Slice", [split, *first], "first_copy")
    moved = own.node("Transpose", [split], "context_moved", perm=[0, 3, 1, 2, 4])
    flat = own.const("out_shape", np.array([0, 0, heads * dim], np.int64))
    own.nodes.append(helper.make_node("Reshape", [moved, flat], [out], name=own.name("out")))


def _bias(shared: _Builder, cache: str, window: int, group: int, dtype: int) -> str:
    """The additive mask [B, 1, G*T, S] (rows g*T + t), 0 where slot s is visible to position t's query, else -inf."""
    tag = f"w{window}" if window else "full"
    slots = shared.node("Shape", [cache], "slots", start=2, end=3)
    count = shared.node("Squeeze", [slots], "slot_count")
    index = shared.node(
        "Range",
        [shared.const("zero", np.array(0, np.int64)), count, shared.const("one", np.array(1, np.int64))],
        "slot_index",
    )
    column = shared.node("Unsqueeze", [POSITIONS, shared.const("axis_2", np.array([2], np.int64))], "query_position")
    visible = shared.node("LessOrEqual", [index, column], "causal")  # [B, T, S]
    if window:
        distance = shared.node("Sub", [column, index], "distance")
        inside = shared.node("Less", [distance, shared.const(f"window_{window}", np.array(window, np.int64))], tag)
        visible = shared.node("And", [visible, inside], f"visible_{tag}")
    zero, minus = shared.scalar(f"zero_{dtype}", 0.0, dtype), shared.scalar(f"minus_inf_{dtype}", -np.inf, dtype)
    bias = shared.node("Where", [visible, zero, minus], f"bias_{tag}_{dtype}")
    bias = shared.node("Unsqueeze", [bias, shared.const("axis_1", np.array([1], np.int64))], f"bias4_{tag}_{dtype}")
    if group > 1:
        reps = shared.const(f"reps_{group}", np.array([1, 1, group, 1], np.int64))
        bias = shared.node("Tile", [bias, reps], f"bias_{tag}_{dtype}_g{group}")
    return bias


def _rotary_op(own, shared, x, tables, heads, dim, rotary_dim, hint) -> str:
    """Rotary embeddings as onnxruntime's RotaryEmbedding operator (ONNX opset 23), on [B, T, heads*D]."""
    cos, sin, _ = tables
    attrs = dict(num_heads=heads, interleaved=0)
    if rotary_dim != dim:
        attrs["rotary_embedding_dim"] = rotary_dim
    return own.node("RotaryEmbedding", [x, cos, sin, POSITIONS], f"{hint}_rotated", **attrs)


def _rotary_elementwise(own, shared, x, tables, heads, dim, rotary_dim, hint) -> str:
    """Rotary embeddings as elementwise operators, as `graphs.ops.apply_rope` computes them: with x1, x2 the halves
    of the first `rotary_dim` features, (x1 cos - x2 sin, x2 cos + x1 sin), the rest passed through. The tables'
    rows for the call's positions are shared by the layers of a segment that turn by the same `table`."""
    cos, sin, table = tables
    half = rotary_dim // 2
    cos_rows = shared.node("Gather", [cos, POSITIONS], f"cos_rows_{table}")  # [B, T, R/2]
    sin_rows = shared.node("Gather", [sin, POSITIONS], f"sin_rows_{table}")
    axis_2 = shared.const("axis_2", np.array([2], np.int64))
    cos_u = shared.node("Unsqueeze", [cos_rows, axis_2], f"cos_heads_{table}")  # [B, T, 1, R/2]
    sin_u = shared.node("Unsqueeze", [sin_rows, axis_2], f"sin_heads_{table}")
    x4 = own.node("Reshape", [x, own.const(f"{hint}_rot_shape", np.array([0, 0, heads, dim], np.int64))], f"{hint}_4")
    axis = own.const("axis_3", np.array([3], np.int64))

    def part(start: int, stop: int, name: str) -> str:
        starts, stops = (
            own.const(f"from_{start}", np.array([start], np.int64)),
            own.const(f"to_{stop}", np.array([stop], np.int64)),
        )
        return own.node("Slice", [x4, starts, stops, axis], f"{hint}_{name}")

    x1, x2 = part(0, half, "x1"), part(half, rotary_dim, "x2")
    first = own.node(
        "Sub",
        [own.node("Mul", [x1, cos_u], f"{hint}_x1_cos"), own.node("Mul", [x2, sin_u], f"{hint}_x2_sin")],
        f"{hint}_r1",
    )
    second = own.node(
        "Add",
        [own.node("Mul", [x2, cos_u], f"{hint}_x2_cos"), own.node("Mul", [x1, sin_u], f"{hint}_x1_sin")],
        f"{hint}_r2",
    )
    pieces = [first, second] + ([part(rotary_dim, dim, "pass")] if rotary_dim < dim else [])
    joined = own.node("Concat", pieces, f"{hint}_joined", axis=3)
    flat = own.const(f"{hint}_flat_shape", np.array([0, 0, heads * dim], np.int64))
    return own.node("Reshape", [joined, flat], f"{hint}_rotated")
