"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama layout with q/k/v in one projection (`qkv_proj`) and gate/up in
one (`gate_up_proj`), partial rotary embeddings (`partial_rotary_factor`), longrope scaling, an optional sliding
window over every layer."""

from __future__ import annotations

import torch

from paradecode.export.families.base import WeightMapper, register
from paradecode.export.families.llama import Llama
from paradecode.export.families.rope import RotaryTable, rotary_table
from paradecode.graphs.spec import ModelSpec


@register
class Phi3(Llama):
    name = "phi3"
    model_types = ("phi3",)
    examples = "Phi-3, Phi-3.5-mini, Phi-4-mini"

    def biases(self, config):
        return False, False

    def windows(self, config):
        window = getattr(config, "sliding_window", None)  # transformers masks every layer with it where it is set
        return () if window is None else (window,) * config.num_hidden_layers

    def rotary(self, model: torch.nn.Module, head_dim: int) -> RotaryTable:
        return rotary_table(self.decoder(model).rotary_emb)  # the first rotary dims turn, the rest pass

    def map_attention(self, m: WeightMapper, src: str, dst: str, spec: ModelSpec) -> None:
        d, dh = spec.hidden_size, spec.head_dim
        q_out, kv_out = spec.num_heads * dh, spec.num_kv_heads * dh
        qkv = m.take(f"{src}self_attn.qkv_proj.weight", (q_out + 2 * kv_out, d))
        for ours, rows in zip("qkv", qkv.split((q_out, kv_out, kv_out))):  # transformers' slices, in its order
            m.out[f"{dst}attn.{ours}.weight"] = rows.contiguous()
        m.put(f"{dst}attn.o.weight", f"{src}self_attn.o_proj.weight", (d, q_out))

    def map_mlp(self, m: WeightMapper, src: str, dst: str, spec: ModelSpec) -> None:
        d, ffn = spec.hidden_size, spec.intermediate_size
        gate, up = m.take(f"{src}mlp.gate_up_proj.weight", (2 * ffn, d)).chunk(2)  # transformers' chunk(2): gate first
        m.out[f"{dst}mlp.gate.weight"], m.out[f"{dst}mlp.up.weight"] = gate.contiguous(), up.contiguous()
        m.put(f"{dst}mlp.down.weight", f"{src}mlp.down_proj.weight", (d, ffn))
