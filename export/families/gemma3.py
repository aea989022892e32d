"""Gemma 3 (`gemma3_text`, and the text part of a `gemma3` checkpoint): the Llama layout with four norms a layer
(the attention's and the MLP's output normed too: sandwich norms), every norm scaling by (1 + weight), RMSNorm on
each query and key head, the attention scaled by `query_pre_attn_scalar`**-0.5, sliding and full layers interleaved
(`layer_types`) with a rotary base of their own for the sliding ones, embeddings scaled by sqrt(hidden), a
GELU-tanh gated MLP, tied embeddings and, where the config sets it, soft-capped logits.

The (1 + weight) is folded into the stored weight in float32, as transformers computes it (`1.0 + weight.float()`),
so a norm multiplies by the same float32 numbers and the family needs no norm of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from paradecode.export.families.base import register
from paradecode.export.families.llama import Llama
from paradecode.export.families.qwen2 import windows_from_layer_types
from paradecode.export.families.rope import RotaryTable, rotary_table
from paradecode.graphs.errors import UnsupportedModelError

FULL, SLIDING = "full_attention", "sliding_attention"
TABLES = {"rope": FULL, "rope_local": SLIDING}  # canonical rotary prefix -> the layer type whose frequencies it holds
MULTIMODAL_PARTS = ("model.vision_tower.", "model.multi_modal_projector.")  # a gemma3 checkpoint's, not the text's


@register
class Gemma3(Llama):
    name = "gemma3"
    model_types = ("gemma3_text", "gemma3")
    examples = "Gemma 3 (text)"
    qk_norm = True
    norms = (
        ("attn_norm", "input_layernorm"),
        ("post_attn_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"),
        ("post_mlp_norm", "post_feedforward_layernorm"),
    )

    def text_config(self, config: Any) -> Any:
        return getattr(config, "text_config", None) or config

    def decoder(self, model: torch.nn.Module) -> torch.nn.Module:
        inner = model.model
        return getattr(inner, "language_model", inner)

    def prefix(self, model: torch.nn.Module) -> str:
        return "model.language_model." if hasattr(model.model, "language_model") else "model."

    def biases(self, config):
        return bool(config.attention_bias), bool(config.attention_bias)

    def windows(self, config):
        return windows_from_layer_types(config)

    def spec(self, config: Any, model: torch.nn.Module):
        text = self.text_config(config)
        for name, value, why in (
            ("attn_logit_softcapping", text.attn_logit_softcapping, "soft-capped attention scores"),
            ("use_bidirectional_attention", text.use_bidirectional_attention, "bidirectional (not causal) attention"),
        ):
            if value:
                raise UnsupportedModelError(
                    f"this Gemma 3 config sets {name}={value!r}: {why} is not in paradecode's attention. Supported: "
                    "Gemma 3's causal text models, whose configs leave it unset."
                )
        unknown = sorted(set(text.layer_types) - {FULL, SLIDING})
        if unknown:
            raise UnsupportedModelError(f"Gemma 3 layer_types {unknown} are not supported; expected {FULL}, {SLIDING}.")
        return super().spec(text, model)

    def rotary(self, model: torch.nn.Module, head_dim: int) -> RotaryTable:
        kinds = set(self.decoder(model).config.layer_types)  # transformers keeps the tables of these kinds only
        tables = {prefix: self.table(model, prefix) for prefix, kind in TABLES.items() if kind in kinds}
        for prefix, table in tables.items():
            if table.inv_freq.numel() * 2 != head_dim:
                raise UnsupportedModelError(
                    f"Gemma 3's {TABLES[prefix]} rotary table turns {table.inv_freq.numel() * 2} of {head_dim} head "
                    "dims; Gemma 3 turns them all."
                )
        if len({(t.scaling, t.max_positions) for t in tables.values()}) > 1:
            raise UnsupportedModelError(
                "Gemma 3's full and sliding rotary tables scale cos and sin differently "
                f"({', '.join(f'{TABLES[p]} {t.scaling}' for p, t in tables.items())}); paradecode keeps one scaling."
            )
        return next(iter(tables.values()))  # the scaling and limit every table shares

    def table(self, model: torch.nn.Module, name: str) -> RotaryTable:
        return rotary_table(self.decoder(model).rotary_emb, TABLES[name])

    def features(self, config: Any, model: torch.nn.Module) -> dict[str, Any]:
        kinds = config.layer_types[: config.num_hidden_layers]
        return {
            "attention_scale": float(config.query_pre_attn_scalar) ** -0.5,
            "local_rope": tuple(kind == SLIDING for kind in kinds) if SLIDING in kinds else (),
            "embed_scale": float(config.hidden_size**0.5),
            "sandwich_norms": True,
            "final_logit_softcap": self.softcap(config, model),
        }

    def softcap(self, config: Any, model: torch.nn.Module) -> float | None:
        """The text config's `final_logit_softcapping`, which transformers' Gemma3ForCausalLM applies and its
        multimodal Gemma3ForConditionalGeneration (what a `gemma3` checkpoint loads as) does not."""
        if config.final_logit_softcapping is None or hasattr(model.model, "language_model"):
            return None
        return float(config.final_logit_softcapping)

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.to(torch.float32)  # Gemma3RMSNorm: output * (1.0 + self.weight.float())

    def final_norm_scale(self, model: torch.nn.Module) -> torch.Tensor:
        return self.norm_weight(self.final_norm(model).weight.detach())

    def other_weights(self, state: dict[str, torch.Tensor]) -> list[str]:
        return [k for k in state if k.startswith(MULTIMODAL_PARTS)]
