"""The shared contracts: spec validation, ops (in-place cache write, masks), the modules vs transformers, manifest."""

import json

import pytest
import torch

from paradecode.export.families import family_for
from paradecode.graphs import ops
from paradecode.graphs.errors import ManifestError, UnsupportedModelError
from paradecode.graphs.manifest import FORMAT_VERSION, read_manifest, verify_files
from paradecode.graphs.modules import build_subgraph
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import export_plan
from tests.tiny_models import tiny_model

SPEC = dict(
    family="llama",
    vocab_size=10,
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    max_position_embeddings=32,
)


def test_spec_validates_itself():
    with pytest.raises(UnsupportedModelError, match="multiple of num_kv_heads"):
        ModelSpec(**dict(SPEC, num_heads=3, num_kv_heads=2))
    with pytest.raises(UnsupportedModelError, match="norm"):
        ModelSpec(**dict(SPEC, norm="batch"))
    with pytest.raises(UnsupportedModelError, match="2 layers"):
        ModelSpec(**dict(SPEC, sliding_windows=(4,)))
    spec = ModelSpec(**dict(SPEC, sliding_windows=(None, 4)))
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.window(1) is None and spec.window(2) == 4


def test_spec_reads_a_manifest_without_the_newer_fields_and_round_trips_them():
    """Manifests written before the rotary, embedding-scale, sandwich-norm and soft-cap fields read with their
    defaults (the features off); a spec with them survives JSON."""
    old = ModelSpec.from_dict(dict(SPEC))
    assert (old.rotary_dims, old.local_rope, old.rope_max_positions, old.embed_scale) == (4, (), None, None)
    assert not old.sandwich_norms and old.final_logit_softcap is None and old.rope_tables == ("rope",)
    new = ModelSpec(
        **SPEC,
        rotary_dim=2,
        local_rope=(True, False),
        rope_max_positions=16,
        embed_scale=8**0.5,
        sandwich_norms=True,
        final_logit_softcap=30.0,
    )
    assert ModelSpec.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    assert (
        new.rope_table(1) == "rope_local" and new.rope_table(2) == "rope" and new.rope_tables == ("rope_local", "rope")
    )
    for bad, message in (
        (dict(rotary_dim=3), "even number"),
        (dict(rotary_dim=6), "even number"),
        (dict(local_rope=(True,)), "1 entries for 2 layers"),
        (dict(final_logit_softcap=0.0), "positive finite"),
        (dict(embed_scale=float("nan")), "positive finite"),
        (dict(rope_max_positions=0), "positive integer"),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            ModelSpec(**SPEC, **bad)


def test_partial_rotary_turns_the_first_dims_as_transformers_phi3_does():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    positions = torch.arange(5).repeat(2, 1) + torch.tensor([[0], [7]])
    inv_freq = torch.tensor([1.0, 0.01])  # 4 of 8 dims turn
    cos, sin = ops.rope_cos_sin(positions, inv_freq, 1.25, torch.float32)
    expected = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    assert torch.equal(ops.apply_rope(q, cos, sin), expected[0]) and torch.equal(
        ops.apply_rope(k, cos, sin), expected[1]
    )
    assert torch.equal(ops.apply_rope(q, cos, sin)[..., 4:], q[..., 4:])


@pytest.mark.parametrize("batch", [1, 3])
def test_write_cache_writes_in_place_at_each_rows_position(batch):
    cache = torch.zeros(batch, 2, 10, 3)
    update = torch.randn(batch, 2, 4, 3)
    starts = torch.tensor([0, 5, 6][:batch])
    out = ops.write_cache(cache, update, starts)
    assert out.data_ptr() == cache.data_ptr()
    for b in range(batch):
        s = int(starts[b])
        assert torch.equal(cache[b, :, s : s + 4], update[b])
        untouched = torch.ones(10, dtype=torch.bool)
        untouched[s : s + 4] = False
        assert torch.count_nonzero(cache[b, :, untouched]) == 0


def test_attention_masks_future_slots_and_the_window():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, 4)
    keys, values = torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4)
    positions = torch.tensor([[7]])
    full = ops.attention(q, keys, values, positions, scale=0.5, window=None)
    garbage = keys.clone()
    garbage[:, :, 8:] = 1e4  # slots after the query position must not matter
    assert torch.allclose(full, ops.attention(q, garbage, values, positions, scale=0.5, window=None))
    windowed = ops.attention(q, keys, values, positions, scale=0.5, window=3)
    reference = ops.attention(q, keys[:, :, 5:8], values[:, :, 5:8], positions - 5, scale=0.5, window=None)
    assert torch.allclose(windowed, reference, atol=1e-6)


def test_modules_reproduce_transformers_logits(family):
    """Prefill then token-by-token decode over fixed caches equals the Hugging Face forward (fp32)."""
    model = tiny_model(family)
    adapter = family_for(model.config.model_type)
    spec = adapter.spec(model.config, model)
    weights = adapter.weights(model, spec)
    plan = export_plan(spec, (1,), dtype="float32", max_seq_len=32)
    modules = {io.name: build_subgraph(spec, io, weights) for io in plan}
    ids = torch.randint(0, spec.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    caches = {
        layer: (
            torch.zeros(1, spec.num_kv_heads, 32, spec.head_dim),
            torch.zeros(1, spec.num_kv_heads, 32, spec.head_dim),
        )
        for layer in range(1, spec.num_layers + 1)
    }
    pieces = []
    with torch.no_grad():
        reference = model(ids).logits
        for start, stop in [(0, 9)] + [(p, p + 1) for p in range(9, 14)]:
            positions = torch.arange(start, stop)[None]
            x = ids[:, start:stop]
            hidden = modules["embed"](x, positions) if spec.positions == "learned" else modules["embed"](x)
            for layer in range(1, spec.num_layers + 1):
                hidden = modules[f"layer_{layer}"](hidden, positions, *caches[layer])[0]
            pieces.append(modules["final"].logits(hidden))
    ours = torch.cat(pieces, dim=1)
    difference = (ours - reference).abs().max().item()
    print(f"{family}: max |logits - transformers| = {difference:.2e} (tolerance 1e-4)")
    assert difference < 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_manifest_refuses_other_versions_and_corrupt_files(exports, tmp_path):
    folder, _ = exports["llama"]
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    copy = tmp_path / "copy"
    copy.mkdir()
    data = json.loads((folder / "manifest.json").read_text())
    data["format_version"] = FORMAT_VERSION + 1
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="Re-export"):
        read_manifest(copy)
    with pytest.raises(ManifestError, match="no manifest.json"):
        read_manifest(tmp_path)
    import shutil

    shutil.rmtree(copy)
    shutil.copytree(folder, copy)
    with open(copy / "onnx" / "layer_2.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff")
    with pytest.raises(ManifestError, match="layer_2.onnx is corrupt"):
        verify_files(copy, read_manifest(copy))
    (copy / "onnx" / "weights.safetensors").unlink()
    with pytest.raises(ManifestError, match="missing files.*weights.safetensors"):
        verify_files(copy, read_manifest(copy))
