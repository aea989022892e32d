"""Segment graphs: the layers between the exit layers in one graph each, composed from the layer graphs.

Their numbers against PyTorch are checked by every export's validation (a failed check fails the export);
here: which segments an export writes, that a composed graph is the chain of its layers (names, in-place
caches, shared weight references), `--no-segments`, and a manifest whose segments do not fit the contract.
"""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch

from paradecode.export.attention import SHARED
from paradecode.graphs.errors import ManifestError
from paradecode.graphs.manifest import read_manifest
from paradecode.graphs.modules import SegmentGraph, build_subgraph
from paradecode.graphs.tensors import segment_ranges


@pytest.mark.parametrize(
    ("layers", "exits", "expected"),
    [
        (30, (8, 15, 23), [(1, 8), (9, 15), (16, 23), (24, 30)]),
        (5, (1, 3, 4), [(2, 3)]),  # single layers are their layer graphs
        (4, (2,), [(1, 2), (3, 4)]),
        (6, (), [(1, 6)]),
    ],
)
def test_segments_cut_the_layers_after_each_exit_layer(layers, exits, expected):
    assert segment_ranges(layers, exits) == expected


@pytest.fixture(scope="module")
def segmented(model_dirs, tmp_path_factory):
    """The tiny llama (4 layers) exported with exit layer 3: segments 1-3 (layer 4 is its layer graph)."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path_factory.mktemp("segmented") / "export"
    return out, export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, max_seq_len=32, exit_layers=(3,)))


def test_an_export_has_the_segments_of_its_exit_layers(segmented):
    folder, result = segmented
    manifest = read_manifest(folder)
    segments = [s.io for s in manifest.subgraphs if s.io.kind == "segment"]
    assert [(io.layer, io.last) for io in segments] == segment_ranges(4, (3,)) == [(1, 3)]
    checked = {c.subject for c in result.checklist.checks if c.status == "ok"}
    assert "segment_1_3" in checked


def test_a_composed_segment_is_its_layers_chained(segmented):
    """Its inputs and outputs are the contract's, each layer's cache in place, its weights the layers' own
    references into the weights file; PyTorch's SegmentGraph gives what the layer modules give in turn."""
    out, _ = segmented
    manifest = read_manifest(out)
    io = manifest.subgraph("segment_1_3").io
    assert io.in_place == {f"present_{kind}.{i}": f"past_{kind}.{i}" for i in (1, 2, 3) for kind in ("key", "value")}
    graph = onnx.load(str(out / "onnx" / "segment_1_3.onnx"), load_external_data=False).graph
    assert [v.name for v in graph.input] == io.input_names and [v.name for v in graph.output] == io.output_names
    layer_refs = set()
    for layer in (1, 2, 3):
        inits = onnx.load(str(out / "onnx" / f"layer_{layer}.onnx"), load_external_data=False).graph.initializer
        layer_refs |= {tuple((e.key, e.value) for e in i.external_data) for i in inits if i.external_data}
    segment_refs = {tuple((e.key, e.value) for e in i.external_data) for i in graph.initializer if i.external_data}
    assert segment_refs == layer_refs  # the same bytes of the one weights file, nothing copied in

    from safetensors.torch import load_file

    weights = load_file(str(out / "onnx" / "weights.safetensors"))
    segment = build_subgraph(manifest.spec, io, weights)
    assert isinstance(segment, SegmentGraph)
    layers = [build_subgraph(manifest.spec, manifest.subgraph(f"layer_{i}").io, weights) for i in (1, 2, 3)]
    hidden, positions = torch.randn(1, 4, manifest.spec.hidden_size), torch.arange(2, 6)[None]
    shape = (1, manifest.spec.num_kv_heads, 32, manifest.spec.head_dim)
    caches = [torch.randn(shape) for _ in range(6)]
    copies = [c.clone() for c in caches]
    with torch.no_grad():
        ours = segment(hidden, positions, *caches)
        expected = hidden
        for i, layer in enumerate(layers):
            expected = layer(expected, positions, copies[2 * i], copies[2 * i + 1])[0]
    assert torch.equal(ours[0], expected)
    assert all(torch.equal(a, b) for a, b in zip(caches, copies))


@pytest.mark.slow
def test_no_segments_writes_none(model_dirs, tmp_path):
    from paradecode.export import cli

    out = tmp_path / "export"
    assert cli.main([str(model_dirs["gpt2"]), "-o", str(out), "--max-seq-len", "32", "--no-segments", "-q"]) == 0
    assert not any(s.io.kind == "segment" for s in read_manifest(out).subgraphs)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda subs: subs[-1]["inputs"][4].update(name="past_key.9"), "inputs are"),
        (lambda subs: subs[-1].update(last=subs[-1]["last"] - 1), "last is"),
    ],
)
def test_segments_that_do_not_fit_the_contract_are_refused(edit, message, segmented, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(segmented[0], folder)
    data = json.loads((folder / "manifest.json").read_text())
    assert data["subgraphs"][-1]["kind"] == "segment"
    edit(data["subgraphs"])
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        read_manifest(folder)


def test_a_segment_computes_what_its_layers_share_once(segmented):
    """A segment's layers share one mask, one write index and one rotary table gather (export/segments.py): each
    shared value is made by one node, and each layer keeps its own softmax."""
    folder, _ = segmented
    manifest = read_manifest(folder)
    segment = next(s for s in manifest.subgraphs if s.io.kind == "segment")
    nodes = onnx.load(str(folder / segment.onnx), load_external_data=False).graph.node
    shared = [n.output[0] for n in nodes if n.output and n.output[0].startswith(SHARED)]
    assert shared and len(shared) == len(set(shared)), shared
    assert sum(n.op_type == "Softmax" for n in nodes) == segment.io.last - segment.io.layer + 1
    assert sum(n.op_type == "TensorScatter" for n in nodes) == 2 * (segment.io.last - segment.io.layer + 1)
