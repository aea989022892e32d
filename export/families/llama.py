"""Llama (Llama 2 / 3 with rope scaling, SmolLM, TinyLlama, ...) and the layout it shares with
Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3: ``model.layers.{i}.self_attn``, a gated MLP, RMSNorm, RoPE.

The other families change what differs by overriding a hook: the norms' names and values (`norms`,
`norm_weight`), how the projections are stored (`map_attention`, `map_mlp`), the rotary table's checks
(`rotary`), the spec's extra features (`features`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from paradecode.export.families.base import Family, WeightMapper, activation_of, register, tied_lm_head_ok
from paradecode.export.families.rope import RotaryTable, rotary_table
from paradecode.graphs.errors import UnsupportedModelError
from paradecode.graphs.spec import ModelSpec


@register
class Llama(Family):
    name = "llama"
    model_types = ("llama",)
    examples = "Llama 2/3, SmolLM, TinyLlama"
    qk_norm = False
    # (our norm, the checkpoint's) per layer.
    norms: ClassVar[tuple[tuple[str, str], ...]] = (
        ("attn_norm", "input_layernorm"),
        ("mlp_norm", "post_attention_layernorm"),
    )

    def biases(self, config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        return bool(config.attention_bias), bool(config.attention_bias)

    def windows(self, config: Any) -> tuple[int | None, ...]:
        return ()

    def decoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's decoder (embedding, layers, final norm, rotary module)."""
        return model.model

    def prefix(self, model: torch.nn.Module) -> str:
        """The decoder's prefix in the state dict."""
        return "model."

    def final_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.decoder(model).norm

    def rotary(self, model: torch.nn.Module, head_dim: int) -> RotaryTable:
        table = rotary_table(self.decoder(model).rotary_emb)
        if table.inv_freq.numel() * 2 != head_dim:
            raise UnsupportedModelError(
                f"partial rotary embeddings ({table.inv_freq.numel() * 2} of {head_dim} head dims) are not supported "
                f"in the {self.name} family."
            )
        return table

    def features(self, config: Any, model: torch.nn.Module) -> dict[str, Any]:
        """ModelSpec fields beyond the Llama layout's (a family's own features)."""
        return {}

    def spec(self, config: Any, model: torch.nn.Module) -> ModelSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        table = self.rotary(model, head_dim)  # "rope": the table every layer reads but those of `local_rope`
        qkv_bias, o_bias = self.biases(config)
        rotary_dim = table.inv_freq.numel() * 2
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
            activation=activation_of(getattr(config, "hidden_act", None) or config.hidden_activation),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=self.qk_norm,
            positions="rope",
            rope_scaling=table.scaling,
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            rope_max_positions=table.max_positions,
            sliding_windows=self.windows(config),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            **self.features(config, model),
        )

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A checkpoint's norm weight as the scale the norm multiplies by."""
        return weight

    def map_attention(self, m: WeightMapper, src: str, dst: str, spec: ModelSpec) -> None:
        d, dh = spec.hidden_size, spec.head_dim
        q_out, kv_out = spec.num_heads * dh, spec.num_kv_heads * dh
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

    def map_mlp(self, m: WeightMapper, src: str, dst: str, spec: ModelSpec) -> None:
        d, ffn = spec.hidden_size, spec.intermediate_size
        for ours, shape in (("gate", (ffn, d)), ("up", (ffn, d)), ("down", (d, ffn))):
            m.put(f"{dst}mlp.{ours}.weight", f"{src}mlp.{ours}_proj.weight", shape)
            if spec.mlp_bias:
                m.put(f"{dst}mlp.{ours}.bias", f"{src}mlp.{ours}_proj.bias", shape[:1])

    def map_norm(self, m: WeightMapper, target: str, source: str, dim: int) -> None:
        m.out[target] = self.norm_weight(m.take(source, (dim,)))

    def weights(self, model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        d, dh, top = spec.hidden_size, spec.head_dim, self.prefix(model)
        m = WeightMapper(state, f"{self.name} weights")
        m.put("embed.tokens.weight", f"{top}embed_tokens.weight", (spec.vocab_size, d))
        for i in range(1, spec.num_layers + 1):
            src, dst = f"{top}layers.{i - 1}.", f"layers.{i}."
            for ours, theirs in self.norms:
                self.map_norm(m, f"{dst}{ours}.weight", f"{src}{theirs}.weight", d)
            self.map_attention(m, src, dst, spec)
            if spec.qk_norm:
                self.map_norm(m, dst + "attn.q_norm.weight", src + "self_attn.q_norm.weight", dh)
                self.map_norm(m, dst + "attn.k_norm.weight", src + "self_attn.k_norm.weight", dh)
            self.map_mlp(m, src, dst, spec)
        self.map_norm(m, "norm.weight", f"{top}norm.weight", d)
        if spec.tie_word_embeddings:
            if not tied_lm_head_ok(state, f"{top}embed_tokens.weight"):
                raise UnsupportedModelError(
                    "the config says tie_word_embeddings, but lm_head differs from the embedding."
                )
            m.used.add("lm_head.weight")
        else:
            m.put("unembed.weight", "lm_head.weight", (spec.vocab_size, d))
        for table in spec.rope_tables:
            m.out[f"{table}.inv_freq"] = self.table(model, table).inv_freq
        m.used.update(self.other_weights(state))
        return m.finish(ignored=("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"))

    def table(self, model: torch.nn.Module, name: str) -> RotaryTable:
        """The rotary table of canonical prefix `name` ("rope", or "rope_local" where a family has one)."""
        return rotary_table(self.decoder(model).rotary_emb)

    def other_weights(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Checkpoint weights that are no part of the language model (a vision tower's), left out on purpose."""
        return []
