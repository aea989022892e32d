"""Llama (Llama 2 / 3 with rope scaling, SmolLM, TinyLlama, ...) and the layout it shares with
Qwen2, Qwen3 and Mistral: ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, gated MLP, RMSNorm, RoPE."""

from __future__ import annotations

from typing import Any

import torch

from paradecode.export.families.base import Family, WeightMapper, activation_of, register, tied_lm_head_ok
from paradecode.graphs.errors import UnsupportedModelError
from paradecode.graphs.spec import ModelSpec

# Rope types whose inverse frequencies do not depend on the sequence length; "dynamic" and
# "longrope" recompute them as the sequence grows, which a fixed graph cannot follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_of(model: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies and cos/sin scaling, as the model's own rotary module computes them."""
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} recomputes its frequencies as the sequence grows and cannot be "
            f"baked into a fixed graph; supported rope types: {STATIC_ROPE_TYPES}."
        )
    inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()
    if inv_freq.numel() * 2 != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({inv_freq.numel() * 2} of {head_dim} head dims) are not supported."
        )
    return inv_freq, float(rotary.attention_scaling)


@register
class Llama(Family):
    name = "llama"
    model_types = ("llama",)
    examples = "Llama 2/3, SmolLM, TinyLlama"
    qk_norm = False

    def biases(self, config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        return bool(config.attention_bias), bool(config.attention_bias)

    def windows(self, config: Any) -> tuple[int | None, ...]:
        return ()

    def final_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.model.norm

    def spec(self, config: Any, model: torch.nn.Module) -> ModelSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        _, rope_scaling = rope_of(model, head_dim)
        qkv_bias, o_bias = self.biases(config)
        return ModelSpec(
            family=self.name,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings,
            norm="rms",
            norm_eps=float(config.rms_norm_eps),
            mlp="gated",
            activation=activation_of(config.hidden_act),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=self.qk_norm,
            positions="rope",
            rope_scaling=rope_scaling,
            sliding_windows=self.windows(config),
            tie_word_embeddings=bool(config.tie_word_embeddings),
        )

    def weights(self, model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        d, dh = spec.hidden_size, spec.head_dim
        q_out, kv_out, ffn = spec.num_heads * dh, spec.num_kv_heads * dh, spec.intermediate_size
        m = WeightMapper(state, f"{self.name} weights")
        m.put("embed.tokens.weight", "model.embed_tokens.weight", (spec.vocab_size, d))
        for i in range(1, spec.num_layers + 1):
            src, dst = f"model.layers.{i - 1}.", f"layers.{i}."
            m.put(dst + "attn_norm.weight", src + "input_layernorm.weight", (d,))
            for ours, out, bias in (
                ("q", q_out, spec.qkv_bias),
                ("k", kv_out, spec.qkv_bias),
                ("v", kv_out, spec.qkv_bias),
                ("o", d, spec.o_bias),
            ):
                in_dim = q_out if ours == "o" else d
                m.put(f"{dst}attn.{ours}.weight", f"{src}self_attn.{ours}_proj.weight", (out, in_dim))
                if bias:
                    m.put(f"{dst}attn.{ours}.bias", f"{src}self_attn.{ours}_proj.bias", (out,))
            if spec.qk_norm:
                m.put(dst + "attn.q_norm.weight", src + "self_attn.q_norm.weight", (dh,))
                m.put(dst + "attn.k_norm.weight", src + "self_attn.k_norm.weight", (dh,))
            m.put(dst + "mlp_norm.weight", src + "post_attention_layernorm.weight", (d,))
            for ours, shape in (("gate", (ffn, d)), ("up", (ffn, d)), ("down", (d, ffn))):
                m.put(f"{dst}mlp.{ours}.weight", f"{src}mlp.{ours}_proj.weight", shape)
                if spec.mlp_bias:
                    m.put(f"{dst}mlp.{ours}.bias", f"{src}mlp.{ours}_proj.bias", shape[:1])
        m.put("norm.weight", "model.norm.weight", (d,))
        if spec.tie_word_embeddings:
            if not tied_lm_head_ok(state, "model.embed_tokens.weight"):
                raise UnsupportedModelError(
                    "the config says tie_word_embeddings, but lm_head differs from the embedding."
                )
            m.used.add("lm_head.weight")
        else:
            m.put("unembed.weight", "lm_head.weight", (spec.vocab_size, d))
        m.out["rope.inv_freq"] = rope_of(model, dh)[0]
        return m.finish(ignored=("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"))
