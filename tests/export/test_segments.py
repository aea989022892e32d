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


@pytest.mark.parametrize(
    ("layers", "exits", "expected"),
    [
        (30, (8, 15, 23), [(1, 8), (9, 15), (16, 23), (24, 30), (1, 30)]),
        (5, (1, 3, 4), [(2, 3), (1, 5)]),
        (2, (1,), [(1, 2)]),  # no range of two layers between the exits: the stack alone
        (6, (), [(1, 6)]),  # no exit layer cuts it: the one range is the stack
        (1, (), []),
    ],
)
def test_the_stack_is_every_layer_in_one_segment(layers, exits, expected):
    assert segment_ranges(layers, exits, stack=True) == expected


@pytest.fixture(scope="module")
def segmented(model_dirs, tmp_path_factory):
    """The tiny llama (4 layers) exported with exit layer 3: segments 1-3 (layer 4 is its layer graph) and the
    stack, 1-4."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path_factory.mktemp("segmented") / "export"
    return out, export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, max_seq_len=32, exit_layers=(3,)))


def test_an_export_has_the_segments_of_its_exit_layers(segmented):
    folder, result = segmented
    manifest = read_manifest(folder)
    segments = [s.io for s in manifest.subgraphs if s.io.kind == "segment"]
    assert [(io.layer, io.last) for io in segments] == segment_ranges(4, (3,), stack=True) == [(1, 3), (1, 4)]
    checked = {c.subject for c in result.checklist.checks if c.status == "ok"}
    assert {"segment_1_3", "segment_1_4"} <= checked
    assert manifest.segments and manifest.stack


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
        (lambda subs: subs[-2]["inputs"][4].update(name="past_key.9"), "inputs are"),
        (lambda subs: subs[-2].update(last=subs[-2]["last"] - 1), "last is"),
        (lambda subs: subs[-1]["inputs"][4].update(name="past_key.9"), "inputs are"),  # the stack
    ],
)
def test_segments_that_do_not_fit_the_contract_are_refused(edit, message, segmented, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(segmented[0], folder)
    data = json.loads((folder / "manifest.json").read_text())
    segments = [(s["kind"], s["layer"], s["last"]) for s in data["subgraphs"][-2:]]
    assert segments == [("segment", 1, 3), ("segment", 1, 4)]
    edit(data["subgraphs"])
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        read_manifest(folder)


def _calls(model) -> list[str]:
    """The subgraphs `model` runs from now on, in order (its backend's `run` recorded)."""
    names, run = [], model.backend.run

    def recording(name, *args, **kwargs):
        names.append(name)
        return run(name, *args, **kwargs)

    model.backend.run = recording
    return names


def _without_stack(source, folder):
    """A copy of the export `source` as exports made before the stack were: no segment_1_L, in the manifest or the
    folder."""
    shutil.copytree(source, folder)
    data = json.loads((folder / "manifest.json").read_text())
    stack = data["subgraphs"].pop()
    assert (stack["kind"], stack["layer"], stack["last"]) == ("segment", 1, 4)
    del data["files"][stack["onnx"]]
    (folder / stack["onnx"]).unlink()
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder


def test_plain_decoding_runs_every_layer_in_one_call_and_exits_run_the_ranges(segmented, tmp_path):
    """With the stack a plain-decoding token is three calls (embed, segment_1_4, final); a frontier that may exit at
    layer 3 runs segment_1_3 and layer 4; an export without the stack (made before it) still loads and runs its
    ranges; every output the same tokens."""
    from paradecode.runtime import load

    old = _without_stack(segmented[0], tmp_path / "old")
    with load(segmented[0]) as model, load(old) as before:
        assert not before.backend.manifest.stack
        calls = _calls(model)
        ar = model.generate(prompt_ids=[1, 5, 9], max_new_tokens=8, mode="ar")
        decode = calls[calls.index("final") + 1 :]  # after the prefill's
        assert decode == ["embed", "segment_1_4", "final"] * (len(decode) // 3) and len(decode) >= 3 * 6
        calls.clear()
        exits = model.generate(prompt_ids=[1, 5, 9], max_new_tokens=8, thresholds=0.0, lookup_tokens=0)
        assert "segment_1_3" in calls and "layer_4" in calls and "segment_1_4" not in calls[calls.index("final") :]
        old_calls = _calls(before)
        assert before.generate(prompt_ids=[1, 5, 9], max_new_tokens=8, mode="ar").token_ids == ar.token_ids
        assert "segment_1_3" in old_calls and "segment_1_4" not in old_calls
    assert exits.token_ids == ar.token_ids
