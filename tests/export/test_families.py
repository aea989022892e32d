"""Family registry and adapters: every registered family has a tiny model; specs and weights are exact."""

import pytest
import torch

from paradecode.export.families import family_for, registered_families
from paradecode.export.families.base import WeightMapper
from paradecode.graphs.errors import UnsupportedModelError
from tests.tiny_models import TINY_CONFIGS, tiny_model


def test_every_registered_family_has_a_tiny_model():
    missing = sorted(set(registered_families()) - set(TINY_CONFIGS))
    assert not missing, f"registered families without a tiny model in tests/tiny_models.py: {missing}"


def test_unsupported_model_type_is_refused_with_the_supported_list():
    with pytest.raises(UnsupportedModelError) as err:
        family_for("bert")
    message = str(err.value)
    assert "'bert'" in message
    for name in registered_families():
        assert name in message


def test_spec_features(family):
    model = tiny_model(family)
    spec = family_for(model.config.model_type).spec(model.config, model)
    expected = {
        "llama": dict(num_heads=6, num_kv_heads=2, head_dim=12, tie_word_embeddings=False, qkv_bias=False),
        "qwen2": dict(qkv_bias=True, o_bias=False, sliding_windows=(None, None, 6, 6), tie_word_embeddings=True),
        "qwen3": dict(qk_norm=True, num_kv_heads=1, head_dim=16),
        "mistral": dict(sliding_windows=(5, 5, 5), group_size=2),
        "gpt2": dict(norm="layer", mlp="plain", positions="learned", activation="gelu_tanh", o_bias=True),
    }[family]
    for name, value in expected.items():
        assert getattr(spec, name) == value, name
    # head_dim != hidden/heads for the llama tiny model: the odd shape is really exercised
    if family == "llama":
        assert spec.head_dim * spec.num_heads != spec.hidden_size
    # llama3 rope scaling changes the frequencies: they must come from the model's own rotary module
    if family == "llama":
        weights = family_for("llama").weights(model, spec)
        assert torch.equal(weights["rope.inv_freq"], model.model.rotary_emb.inv_freq.float())


def test_weights_are_complete_and_unembed_follows_tying(family):
    model = tiny_model(family)
    adapter = family_for(model.config.model_type)
    spec = adapter.spec(model.config, model)
    weights = adapter.weights(model, spec)
    assert ("unembed.weight" in weights) == (not spec.tie_word_embeddings)
    for i in range(1, spec.num_layers + 1):
        assert f"layers.{i}.attn.q.weight" in weights
    assert not any(k.startswith("layers.0.") for k in weights), "layers are numbered from 1"


def test_weight_mapper_refuses_unmapped_weights():
    mapper = WeightMapper({"a": torch.zeros(2), "surprise": torch.zeros(3)}, "test")
    mapper.put("x", "a", (2,))
    with pytest.raises(UnsupportedModelError, match="surprise"):
        mapper.finish()


def test_weight_mapper_checks_shapes():
    mapper = WeightMapper({"a": torch.zeros(2, 3)}, "test")
    with pytest.raises(UnsupportedModelError, match=r"shape \(2, 3\).*expected \(3, 3\)"):
        mapper.take("a", (3, 3))


def test_final_norm_and_lm_head_are_the_models_own(family):
    """The family's final norm makes the model's last hidden state, and its LM head the model's logits."""
    model = tiny_model(family)
    adapter = family_for(model.config.model_type)
    norm, lm_head = adapter.final_norm(model), adapter.lm_head(model)
    calls = []
    hook = norm.register_forward_hook(lambda module, args, output: calls.append((args[0], output)))
    try:
        with torch.no_grad():
            out = model(torch.tensor([[3, 1, 4, 1, 5, 9]]), output_hidden_states=True)
    finally:
        hook.remove()
    assert len(calls) == 1, f"{family}: the module given as the final norm ran {len(calls)} times in a forward pass"
    before, after = calls[0]
    torch.testing.assert_close(after, out.hidden_states[-1])
    with torch.no_grad():
        torch.testing.assert_close(lm_head(norm(before)), out.logits)
