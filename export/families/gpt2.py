"""GPT-2: learned positions, LayerNorm with biases, fused c_attn and Conv1D weights ([in, out])."""

from __future__ import annotations

from typing import Any

import torch

from paradecode.export.families.base import Family, WeightMapper, activation_of, register, tied_lm_head_ok
from paradecode.graphs.errors import UnsupportedModelError
from paradecode.graphs.spec import ModelSpec


@register
class GPT2(Family):
    name = "gpt2"
    model_types = ("gpt2",)
    examples = "GPT-2, DistilGPT-2"

    def spec(self, config: Any, model: torch.nn.Module) -> ModelSpec:
        if config.scale_attn_by_inverse_layer_idx:
            raise UnsupportedModelError("GPT-2 with scale_attn_by_inverse_layer_idx=True is not supported.")
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError(
                "GPT-2 with cross-attention is an encoder-decoder; only decoder-only models are supported."
            )
        head_dim = config.n_embd // config.n_head
        return ModelSpec(
            family=self.name,
            vocab_size=config.vocab_size,
            hidden_size=config.n_embd,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=head_dim,
            intermediate_size=config.n_inner or 4 * config.n_embd,
            max_position_embeddings=config.n_positions,
            norm="layer",
            norm_eps=float(config.layer_norm_epsilon),
            mlp="plain",
            activation=activation_of(config.activation_function),
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            positions="learned",
            attention_scale=None if config.scale_attn_weights else 1.0,
            tie_word_embeddings=bool(config.tie_word_embeddings),
        )

    def final_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.transformer.ln_f

    def weights(self, model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        d, ffn = spec.hidden_size, spec.intermediate_size
        m = WeightMapper(state, "gpt2 weights")
        m.put("embed.tokens.weight", "transformer.wte.weight", (spec.vocab_size, d))
        m.put("embed.positions.weight", "transformer.wpe.weight", (spec.max_position_embeddings, d))
        for i in range(1, spec.num_layers + 1):
            src, dst = f"transformer.h.{i - 1}.", f"layers.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                m.put(f"{dst}{ours}.weight", f"{src}{theirs}.weight", (d,))
                m.put(f"{dst}{ours}.bias", f"{src}{theirs}.bias", (d,))
            # Conv1D stores [in, out]: transpose to the Linear layout, then split the fused q/k/v.
            qkv_w = m.take(src + "attn.c_attn.weight", (3 * d, d), transpose=True)
            qkv_b = m.take(src + "attn.c_attn.bias", (3 * d,))
            for ours, w, b in zip("qkv", qkv_w.split(d), qkv_b.split(d)):
                m.out[f"{dst}attn.{ours}.weight"], m.out[f"{dst}attn.{ours}.bias"] = w.contiguous(), b.contiguous()
            m.put(dst + "attn.o.weight", src + "attn.c_proj.weight", (d, d), transpose=True)
            m.put(dst + "attn.o.bias", src + "attn.c_proj.bias", (d,))
            m.put(dst + "mlp.up.weight", src + "mlp.c_fc.weight", (ffn, d), transpose=True)
            m.put(dst + "mlp.up.bias", src + "mlp.c_fc.bias", (ffn,))
            m.put(dst + "mlp.down.weight", src + "mlp.c_proj.weight", (d, ffn), transpose=True)
            m.put(dst + "mlp.down.bias", src + "mlp.c_proj.bias", (d,))
        m.put("norm.weight", "transformer.ln_f.weight", (d,))
        m.put("norm.bias", "transformer.ln_f.bias", (d,))
        if spec.tie_word_embeddings:
            if not tied_lm_head_ok(state, "transformer.wte.weight"):
                raise UnsupportedModelError("the config says tie_word_embeddings, but lm_head differs from wte.")
            m.used.add("lm_head.weight")
        else:
            m.put("unembed.weight", "lm_head.weight", (spec.vocab_size, d))
        # Older checkpoints carry the causal-mask buffers attn.bias / attn.masked_bias: not weights.
        return m.finish(ignored=(".attn.bias", ".attn.masked_bias"))
