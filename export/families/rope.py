"""Rotary tables as a Hugging Face model's own rotary module computes them, for every family with rotary positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradecode.graphs.errors import UnsupportedModelError

# Rope types whose frequencies a fixed table holds. "dynamic" recomputes them as the sequence grows; "longrope" keeps
# its short factors up to `original_max_position_embeddings` and switches the whole sequence to its long factors past
# it, so a table of the short factors is exact up to that length (`RotaryTable.max_positions`) and no further.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RotaryTable:
    inv_freq: torch.Tensor  # float32 [rotary dims / 2]
    scaling: float  # what cos and sin are multiplied by (transformers' `attention_scaling`)
    max_positions: int | None  # the positions the table gives exactly what transformers computes; None: any


def rotary_table(rotary: torch.nn.Module, layer_type: str | None = None) -> RotaryTable:
    """The table of a transformers rotary module (`model.model.rotary_emb`), of `layer_type`'s frequencies where the
    module keeps one per kind of layer (Gemma 3: "full_attention", "sliding_attention")."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    rope_type = getattr(rotary, "rope_type", "default")
    if layer_type is not None:
        rope_type = rope_type[layer_type]
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} recomputes its frequencies as the sequence grows and cannot be baked into a "
            f"fixed graph; supported rope types: {STATIC_ROPE_TYPES}."
        )
    max_positions = None
    inv_freq = getattr(rotary, f"{prefix}inv_freq")
    if rope_type == "longrope":  # the short factors: transformers' frequencies up to the original length
        inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
        parameters = rotary.config.rope_parameters
        parameters = parameters if layer_type is None else parameters[layer_type]
        max_positions = int(parameters["original_max_position_embeddings"])
    scaling = getattr(rotary, f"{prefix}attention_scaling")
    return RotaryTable(inv_freq.detach().to(torch.float32).clone(), float(scaling), max_positions)
