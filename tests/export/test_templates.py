"""Graph templates in half precision: every layer of a bfloat16 or float16 export comes from the first layer's
template, as in float32, and computes what a graph traced from the layer itself computes.

The tiny qwen3's layer graphs read float32 rotary tables (export/attention.py) that the exporter casts to the
activations' dtype, the cast a template must carry.
"""

import logging

import onnx
import pytest
import torch
from safetensors.torch import load_file

from paradecode.export.config import ExportConfig
from paradecode.export.onnx_export import ONNX_DTYPES, GraphTemplate, tensor_of
from paradecode.export.pipeline import export_model
from paradecode.graphs.manifest import WEIGHTS_NAME, read_manifest
from paradecode.graphs.modules import build_subgraph
from paradecode.graphs.ops import TORCH_DTYPES

FAMILY = "qwen3"
SEQ_LEN = 32


def made(caplog) -> dict[str, str]:
    """Subgraph -> how the export's progress lines say it was made: traced, from template or composed."""
    progress = [r for r in caplog.records if r.name == "paradecode.export.pipeline" and r.msg.startswith("[%2d/%d]")]
    return {r.args[2]: r.args[3] for r in progress}


def resolved_initializers(path) -> dict[str, torch.Tensor]:
    """The graph's constants as it computes with them: its initializers read from the weights file, and what its
    Cast and Transpose nodes of stored weights make of them."""
    graph = onnx.load(str(path)).graph  # loads the external data too
    values = {init.name: tensor_of(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type not in ("Cast", "Transpose") or node.input[0] not in values:
            continue
        value = values[node.input[0]]
        if node.op_type == "Cast":
            values[node.output[0]] = value.to(ONNX_DTYPES[onnx.helper.get_attribute_value(node.attribute[0])])
        else:
            values[node.output[0]] = value.t()
    return values


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_layers_come_from_the_template(model_dirs, tmp_path, caplog, dtype):
    """Each layer after the first is instantiated from its template, reading the float32 rotary tables from the
    weights file through a Cast; its constants equal those of the layer traced from its own weights, and the
    export validates (float16 in onnxruntime; bfloat16, which the CPU provider cannot run, is skipped there)."""
    caplog.set_level(logging.INFO, logger="paradecode.export.pipeline")
    out = tmp_path / "export"
    result = export_model(ExportConfig(model=str(model_dirs[FAMILY]), output=out, dtype=dtype, max_seq_len=SEQ_LEN))
    manifest = read_manifest(out)
    assert manifest.spec.positions == "rope", "the test needs a model whose layers read rotary tables"
    layers = [s.io.name for s in manifest.subgraphs if s.io.kind == "layer"]
    how = made(caplog)
    assert [how[name] for name in layers] == ["traced"] + ["from template"] * (len(layers) - 1), how
    assert not result.checklist.failed, result.checklist.lines()
    statuses = {c.status for c in result.checklist.checks if c.subject in layers}
    assert statuses == ({"skip"} if dtype == "bfloat16" else {"ok"}), result.checklist.lines()

    last = manifest.subgraph(layers[-1])
    graph = onnx.load(str(out / last.onnx), load_external_data=False).graph
    casts = [n for n in graph.node if n.op_type == "Cast" and n.input[0].endswith("__stored")]
    assert len(casts) == 2, "the rotary tables (cos and sin) are read through a Cast"
    assert not [i.name for i in graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL and len(i.dims) > 1]

    # The graph traced from the layer's own weights (what a half-precision export wrote before templates served
    # it) folds the casts into constants: the template's graph must compute with the same values.
    own = traced_from_own_weights(manifest, last.io, load_file(str(out / WEIGHTS_NAME)))
    resolved = resolved_initializers(out / last.onnx)
    for init in own.model.graph.initializer:
        assert init.name in resolved, f"{init.name} is not in the template's graph"
        expected, got = tensor_of(init), resolved[init.name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), f"{init.name} differs"


def traced_from_own_weights(manifest, io, weights: dict[str, torch.Tensor]) -> GraphTemplate:
    dtype = TORCH_DTYPES[manifest.dtype]
    module = build_subgraph(manifest.spec, io, weights, dtype=dtype, ops=manifest.ops, max_seq_len=manifest.max_seq_len)
    return GraphTemplate.trace(
        module,
        io,
        vocab_size=manifest.spec.vocab_size,
        dtype=dtype,
        opset=manifest.opset,
        max_batch=manifest.max_batch,
        max_seq_len=manifest.max_seq_len,
    )
