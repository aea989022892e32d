"""Family registry and adapters: every registered family has a tiny model; specs and weights are exact."""

import math

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
        "gemma3": dict(
            qk_norm=True,
            num_kv_heads=1,
            head_dim=20,
            activation="gelu_tanh",
            sliding_windows=(5, 5, None, 5),
            local_rope=(True, True, False, True),
            attention_scale=24**-0.5,
            embed_scale=48**0.5,
            sandwich_norms=True,
            final_logit_softcap=15.0,
            tie_word_embeddings=True,
        ),
        "phi3": dict(
            rotary_dim=4,
            head_dim=8,
            rope_max_positions=64,
            rope_scaling=(1 + math.log(4) / math.log(64)) ** 0.5,
            sliding_windows=(7, 7, 7),
            tie_word_embeddings=False,
        ),
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
    cap = adapter.spec(model.config, model).final_logit_softcap  # the model's logits are capped after its LM head
    with torch.no_grad():
        logits = lm_head(norm(before))
        torch.testing.assert_close(logits if cap is None else torch.tanh(logits / cap) * cap, out.logits)
    scale = adapter.final_norm_scale(model)  # what the norm multiplies by: the norm of a vector of rms 1
    unit = torch.ones(model.config.get_text_config().hidden_size)
    if spec_norm(adapter, model) == "rms":
        with torch.no_grad():
            torch.testing.assert_close(norm(unit[None])[0], scale, rtol=1e-5, atol=1e-5)


def spec_norm(adapter, model) -> str:
    return adapter.spec(model.config, model).norm


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_canonical_weights_are_transformers_own_as_our_modules_use_them(family):
    """Gemma 3's norms hold 1 + weight in float32, exactly transformers' `1.0 + weight.float()`; Phi-3's fused q/k/v
    and gate/up are split in transformers' order; Gemma 3's rotary tables are its full and sliding layers' own."""
    model = tiny_model(family)
    adapter = family_for(model.config.model_type)
    spec = adapter.spec(model.config, model)
    weights = adapter.weights(model, spec)
    state = model.state_dict()
    layer = "model.layers.1."
    if family == "gemma3":
        for ours, theirs in adapter.norms:
            assert torch.equal(weights[f"layers.2.{ours}.weight"], 1.0 + state[f"{layer}{theirs}.weight"].float())
        assert torch.equal(weights["layers.2.attn.q_norm.weight"], 1.0 + state[f"{layer}self_attn.q_norm.weight"])
        assert torch.equal(weights["norm.weight"], 1.0 + state["model.norm.weight"])
        rotary = model.model.rotary_emb
        assert torch.equal(weights["rope.inv_freq"], rotary.full_attention_inv_freq)
        assert torch.equal(weights["rope_local.inv_freq"], rotary.sliding_attention_inv_freq)
        assert not torch.equal(weights["rope.inv_freq"], weights["rope_local.inv_freq"])
        assert [spec.rope_table(i) for i in (1, 2, 3, 4)] == ["rope_local", "rope_local", "rope", "rope_local"]
    else:
        q, k, v = state[f"{layer}self_attn.qkv_proj.weight"].split((48, 16, 16))
        gate, up = state[f"{layer}mlp.gate_up_proj.weight"].chunk(2)
        for ours, theirs in (("attn.q", q), ("attn.k", k), ("attn.v", v), ("mlp.gate", gate), ("mlp.up", up)):
            assert torch.equal(weights[f"layers.2.{ours}.weight"], theirs), ours
        assert torch.equal(weights["rope.inv_freq"], model.model.rotary_emb.original_inv_freq)
        assert weights["rope.inv_freq"].numel() * 2 == spec.rotary_dim < spec.head_dim
        assert "rope_local.inv_freq" not in weights


@pytest.mark.slow
def test_a_gemma3_checkpoints_text_part_exports_as_transformers_computes_it(tmp_path):
    """A `gemma3` checkpoint loads as Gemma3ForConditionalGeneration: its language model is exported (the vision
    tower and projector left out), without the logit cap that class does not apply, and decodes as its `generate`."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.onnx_export import stored_tensors
    from paradecode.export.pipeline import export_model
    from paradecode.runtime import load
    from tests.tiny_models import tiny_gemma3_multimodal

    model = tiny_gemma3_multimodal()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and model.config.text_config.final_logit_softcapping
    model.save_pretrained(tmp_path / "model")
    result = export_model(ExportConfig(model=str(tmp_path / "model"), output=tmp_path / "export", max_seq_len=64))
    spec = result.manifest.spec
    assert spec.family == "gemma3" and spec.final_logit_softcap is None and spec.local_rope == (True, True, False, True)
    stored = stored_tensors(tmp_path / "export" / result.manifest.weights)
    assert "embed.tokens.weight" in stored and not [k for k in stored if "vision" in k or "projector" in k]
    prompt = [5, 9, 3, 7, 11, 4, 8, 2, 6]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    with load(tmp_path / "export") as loaded:
        ar = loaded.generate(prompt_ids=prompt, max_new_tokens=20, mode="ar", ignore_eos=True)
    assert ar.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50\.0: soft-capped attention scores"),
        (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True: bidirectional"),
    ],
    ids=["attention-softcap", "bidirectional"],
)
def test_gemma3_features_the_attention_cannot_represent_are_refused(change, message):
    from tests.tiny_models import TINY_CONFIGS

    configs = {"gemma3": {**TINY_CONFIGS["gemma3"], **change}}
    model = tiny_model("gemma3", configs=configs)
    with pytest.raises(UnsupportedModelError, match=message):
        family_for("gemma3_text").spec(model.config, model)


def test_a_dynamic_rope_is_refused_and_longrope_is_exact_up_to_its_original_length(model_dirs, tmp_path, capsys):
    """longrope switches to its long factors past original_max_position_embeddings (64 in the tiny phi3): an export
    holding more positions is refused before any work, naming the limit and the fix; the default stays within it."""
    from paradecode.export import cli
    from tests.tiny_models import TINY_CONFIGS

    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model = tiny_model("llama", configs={"llama": {**TINY_CONFIGS["llama"], "rope_parameters": dynamic}})
    with pytest.raises(UnsupportedModelError, match=r"rope type 'dynamic' recomputes its frequencies"):
        family_for("llama").spec(model.config, model)
    assert cli.main([str(model_dirs["phi3"]), "-o", str(tmp_path / "out"), "--max-seq-len", "65"]) == 2
    err = capsys.readouterr().err
    assert "--max-seq-len 65 exceeds the 64 positions" in err and "Use --max-seq-len 64 or less" in err, err
    assert not (tmp_path / "out").exists()
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import resolve_max_seq_len

    phi3 = tiny_model("phi3")
    spec = family_for("phi3").spec(phi3.config, phi3)
    assert resolve_max_seq_len(ExportConfig(model="m", output=tmp_path / "o"), spec) == 64  # not 2048, nor 256
