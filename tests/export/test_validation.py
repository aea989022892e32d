"""What paradecode-export's validation judges (export/validate.py): int8-activation graphs on inputs at the model's own
scale, each line's error beside the bound it was held to, and a graph that computes something else refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paradecode.export import validate
from paradecode.graphs.errors import ValidationError
from tests.conftest import MIXED_BLOCKS


def test_channel_scale_is_each_channels_rms_over_the_rows_written():
    hidden = torch.tensor([[[3.0, 0.0], [4.0, 2.0], [0.0, 0.0]]])  # [1, 3, 2]: the last row unwritten
    scale = validate.channel_scale([hidden, torch.tensor([[[0.0, 4.0]]])], cache=False)
    assert torch.allclose(scale, torch.tensor([(25 / 3) ** 0.5, (20 / 3) ** 0.5]))
    cache = torch.zeros(1, 2, 4, 2)  # [B, H, S, D], two slots written
    cache[0, 0, :2] = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    cache[0, 1, :2] = torch.tensor([[10.0, 0.0], [0.0, 0.0]])
    scale = validate.channel_scale([cache], cache=True)
    assert scale.shape == (1, 2, 1, 2)
    assert torch.allclose(scale[0, :, 0], torch.tensor([[1.0, 2.0], [50**0.5, 1e-6]]))
    assert torch.equal(validate.channel_scale([torch.zeros(1, 2, 3, 2)], cache=True), torch.ones(1, 2, 1, 2))


def test_random_inputs_like_a_real_call_take_its_scale():
    from paradecode.graphs.tensors import HIDDEN, subgraph_io

    spec = SimpleNamespace(hidden_size=4, vocab_size=10)  # all the final head's contract reads
    io = subgraph_io(spec, "final", dtype="float32", max_seq_len=8)
    generator = torch.Generator().manual_seed(0)
    real = [{HIDDEN: torch.tensor([[[100.0, 1.0, 0.01, 5.0]]])}]
    inputs = validate.random_inputs(
        io, spec, max_seq_len=4096, max_batch=1, tokens=4096, dtype=torch.float32, generator=generator, like=real
    )
    rms = inputs[HIDDEN].reshape(-1, 4).pow(2).mean(0).sqrt()
    assert torch.allclose(rms / torch.tensor([100.0, 1.0, 0.01, 5.0]), torch.ones(4), atol=0.1)


def test_a_line_shows_the_error_beside_its_bound():
    expected = {"hidden_out": torch.tensor([[3.0, 4.0]])}
    check = validate.compare("layer_1", "random T=1", expected, {"hidden_out": torch.tensor([[3.0, 4.4]])}, INT8)
    assert check.status == "ok" and check.l2_ratio == pytest.approx(0.08)
    assert "|Δ|₂ 0.080·|ref|₂ (|Δ|₂ <= 0.1·|ref|₂; max|Δ| 4.0e-01)" in check.line(), check.line()
    worse = validate.compare("layer_1", "random T=1", expected, {"hidden_out": torch.tensor([[3.0, 5.0]])}, INT8)
    assert worse.status == "FAIL" and "|Δ|₂ 0.200·|ref|₂ (|Δ|₂ <= 0.1·|ref|₂" in worse.line(), worse.line()
    plain = validate.compare("final", "real 0", expected, expected, validate.TOLERANCES["float32"])
    assert plain.l2_ratio is None and "max|Δ| 0.0e+00 (atol 0.0001 rtol 0.001)" in plain.line()


INT8 = validate.INT8_ACTIVATIONS


@pytest.mark.slow
def test_an_int8_export_whose_graph_computes_something_else_is_refused(tmp_path, monkeypatch):
    """One layer's stored weights scaled by 1.5 after the PyTorch modules were built from the right ones: the graph
    computes another layer, and validation refuses the export (nothing is written), naming the graph and its bound;
    the same export unchanged passes."""
    import safetensors.torch

    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.tiny_gguf import write_tiny_gguf

    model = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(model, family="llama", block_types=MIXED_BLOCKS, tied=False)

    def config(name):
        return ExportConfig(model=str(model), output=tmp_path / name, max_seq_len=64, activations="int8")

    export_model(config("right"))
    real_save = safetensors.torch.save_file

    def corrupted(tensors, path, metadata=None):
        names = [n for n in tensors if n.startswith("layers.1.mlp.down.") and tensors[n].is_floating_point()]
        assert names, sorted(tensors)
        tensors = {**tensors, names[0]: tensors[names[0]] * 1.5}
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", corrupted)
    with pytest.raises(ValidationError) as refused:
        export_model(config("wrong"))
    message = str(refused.value)
    assert "[FAIL]  layer_1" in message and "|Δ|₂" in message and "(|Δ|₂ <= 0.1·|ref|₂" in message, message
    assert not (tmp_path / "wrong").exists()
