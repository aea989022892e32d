"""Segment graphs composed from the layers' own graphs: layers a..b in one graph, no tracing.

A segment is the layer graphs a..b wired together: layer i's `hidden_out` feeds layer i + 1's `hidden`,
every layer reads the segment's `positions`, and its caches become the segment's `past_key.i` /
`past_value.i` -> `present_key.i` / `present_value.i` (graphs/tensors.py). Everything else a layer graph
names is prefixed with `/layer_i/`, so names never collide, except what every layer's attention shares (names
under `export.attention.SHARED`: the write index, the masks, the rotary tables' rows for the call's positions),
which the first layer that has it computes once for all (every cache of a call has the same slots: the first
layer's cache stands for all). Its weights stay references into the export's weights file, as the layers' are; a
reference to the same bytes made by several layers (the rotary tables) is kept once. The composed graph is then
validated like every other, against `SegmentGraph`.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from paradecode.export.attention import SHARED
from paradecode.graphs.errors import ValidationError
from paradecode.graphs.tensors import (
    HIDDEN,
    HIDDEN_OUT,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PRESENT_KEY,
    PRESENT_VALUE,
    SubgraphIO,
    of_layer,
)


def _external_key(init: TensorProto) -> tuple | None:
    """Where an external initializer's bytes lie (location, offset, length), None for one held inline."""
    if init.data_location != TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in init.external_data}
    return (entries.get("location"), entries.get("offset"), entries.get("length"), init.data_type, tuple(init.dims))


def segment_from_layers(io: SubgraphIO, layers: dict[int, onnx.ModelProto]) -> onnx.ModelProto:
    """The segment `io` (layers io.layer..io.last) composed from those layers' graphs."""
    first, last = io.layer, io.last
    missing = [i for i in range(first, last + 1) if i not in layers]
    if missing:
        raise ValidationError(f"{io.name}: the graphs of layers {missing} are needed to compose it.")
    model = onnx.ModelProto()
    model.CopyFrom(layers[first])
    graph = model.graph
    del graph.node[:], graph.initializer[:], graph.input[:], graph.output[:], graph.value_info[:]
    graph.name = io.name
    shared: dict[tuple, str] = {}  # external bytes -> the initializer name that holds them
    made: dict[str, onnx.NodeProto] = {}  # a shared output -> the node that makes it (the first layer's)
    kept: set[str] = set()  # the shared initializers and value infos already in the graph
    hidden = HIDDEN
    for layer in range(first, last + 1):
        source = layers[layer].graph
        prefix = f"/layer_{layer}/"
        renamed = {
            HIDDEN: hidden,
            POSITIONS: POSITIONS,
            PAST_KEY: of_layer(PAST_KEY, layer),
            PAST_VALUE: of_layer(PAST_VALUE, layer),
            PRESENT_KEY: of_layer(PRESENT_KEY, layer),
            PRESENT_VALUE: of_layer(PRESENT_VALUE, layer),
            HIDDEN_OUT: HIDDEN_OUT if layer == last else prefix + HIDDEN_OUT,
            "": "",  # an omitted optional input or output stays omitted
        }
        for init in source.initializer:
            if init.name.startswith(SHARED):
                renamed[init.name] = init.name
                if init.name not in kept:
                    kept.add(init.name)
                    graph.initializer.add().CopyFrom(init)
                continue
            key = _external_key(init)
            if key is not None and key in shared:
                renamed[init.name] = shared[key]
                continue
            renamed[init.name] = prefix + init.name
            copy = graph.initializer.add()
            copy.CopyFrom(init)
            copy.name = renamed[init.name]
            if key is not None:
                shared[key] = copy.name

        def name_of(value: str, prefix=prefix, renamed=renamed) -> str:
            return value if value.startswith(SHARED) else renamed.get(value, prefix + value)

        for node in source.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise ValidationError(f"{io.name}: layer {layer}'s node {node.name} holds a subgraph; not composable.")
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = node.name if node.name.startswith(SHARED) else prefix + node.name if node.name else ""
            copy.input[:] = [name_of(v) for v in node.input]
            copy.output[:] = [name_of(v) for v in node.output]
            if copy.output and copy.output[0].startswith(SHARED):
                earlier = made.get(copy.output[0])
                if earlier is not None:
                    _check_same(io, layer, earlier, copy)
                    continue  # made once, by the first layer that has it
                made[copy.output[0]] = copy
            graph.node.add().CopyFrom(copy)
        for info in source.value_info:
            name = name_of(info.name)
            if name.startswith(SHARED):
                if name in kept:
                    continue
                kept.add(name)
            copy = graph.value_info.add()
            copy.CopyFrom(info)
            copy.name = name
        for value in source.input:
            if value.name == HIDDEN and layer != first:
                continue  # fed by the layer before
            if value.name == POSITIONS and layer != first:
                continue
            copy = graph.input.add()
            copy.CopyFrom(value)
            copy.name = name_of(value.name)
        for value in source.output:
            if value.name == HIDDEN_OUT and layer != last:
                continue  # feeds the next layer
            copy = graph.output.add()
            copy.CopyFrom(value)
            copy.name = name_of(value.name)
        hidden = prefix + HIDDEN_OUT
    _order_like(graph.input, io.input_names)
    _order_like(graph.output, io.output_names)
    return model


def _check_same(io: SubgraphIO, layer: int, first: onnx.NodeProto, node: onnx.NodeProto) -> None:
    """A shared node of a later layer must compute what the first one's does: the same operator, attributes and
    inputs, each layer's cache counting as the first's (they have the same slots)."""

    def key(n: onnx.NodeProto) -> tuple:
        inputs = [v.split(".")[0] if v.startswith((PAST_KEY, PAST_VALUE)) else v for v in n.input]
        return n.op_type, n.domain, tuple(inputs), tuple(a.SerializeToString() for a in n.attribute)

    if key(first) != key(node):
        raise ValidationError(
            f"{io.name}: layer {layer} computes the shared {node.output[0]} otherwise than an earlier layer "
            f"({node.op_type} of {list(node.input)} against {first.op_type} of {list(first.input)}); not composable."
        )


def _order_like(values, names: list[str]) -> None:
    """Put a graph's inputs or outputs in the contract's order (names must match exactly)."""
    by_name = {v.name: v for v in values}
    if set(by_name) != set(names):
        raise ValidationError(
            f"a composed segment has {sorted(by_name)}; the contract has {sorted(names)} "
            f"(missing {sorted(set(names) - set(by_name))}, unexpected {sorted(set(by_name) - set(names))})."
        )
    ordered = []
    for name in names:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(by_name[name])
        ordered.append(copy)
    del values[:]
    values.extend(ordered)
