"""`ModelSpec`: everything the subgraph modules need to know about a decoder-only model.

A spec is family-neutral: each supported architecture is described by the features it uses
(norm kind, MLP kind, biases, q/k norm, position kind, sliding windows, rotary tables, embedding scale,
sandwich norms, logit soft-capping). The exporter's family
adapters build a spec from a Hugging Face config; the manifest stores it; the runtime rebuilds the
torch modules from it without transformers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from paradecode.graphs.errors import UnsupportedModelError

NORMS = ("rms", "layer")
MLPS = ("gated", "plain")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
POSITIONS = ("rope", "learned")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and features of a decoder-only transformer, as the subgraph modules use them.

    Layers are numbered 1..num_layers, as in docs/design.md §3. `sliding_windows` holds one entry per
    layer (None: full attention); an empty tuple means every layer attends to the full cache.

    Rotary positions: `rotary_dim` of each head's dims turn (the first ones, as Hugging Face's Phi-3 does; None:
    all of head_dim), by the inverse frequencies `rope.inv_freq`, or `rope_local.inv_freq` for the layers
    `local_rope` marks (Gemma 3's sliding layers; an empty tuple: none), cos and sin scaled by `rope_scaling`.
    `rope_max_positions` bounds the positions those fixed tables give exactly what transformers computes
    (longrope switches to its long factors past `original_max_position_embeddings`); None: no bound of their own.
    `embed_scale` multiplies the embedding (as a float32 scalar cast to the activations' dtype, Gemma's
    sqrt(hidden)); `sandwich_norms` adds a norm to the attention's and the MLP's output before each residual sum
    (Gemma's post-attention and post-feedforward norms); `final_logit_softcap` caps the heads' logits as
    cap * tanh(logits / cap). Norms scale by their stored weight: a family whose norm scales by (1 + w) stores 1 + w.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm: str = "rms"
    norm_eps: float = 1e-5
    mlp: str = "gated"
    activation: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    positions: str = "rope"
    rope_scaling: float = 1.0
    attention_scale: float | None = None
    sliding_windows: tuple[int | None, ...] = ()
    tie_word_embeddings: bool = False
    rotary_dim: int | None = None
    local_rope: tuple[bool, ...] = ()
    rope_max_positions: int | None = None
    embed_scale: float | None = None
    sandwich_norms: bool = False
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"ModelSpec.{name} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads}): "
                "grouped-query attention needs every key/value head to serve the same number of query heads."
            )
        for name, value, allowed in (
            ("norm", self.norm, NORMS),
            ("mlp", self.mlp, MLPS),
            ("activation", self.activation, ACTIVATIONS),
            ("positions", self.positions, POSITIONS),
        ):
            if value not in allowed:
                raise UnsupportedModelError(f"ModelSpec.{name}={value!r} is not supported; expected one of {allowed}.")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers."
            )
        if any(w is not None and w < 1 for w in self.sliding_windows):
            raise UnsupportedModelError(f"sliding windows must be positive, got {self.sliding_windows}.")
        self._check_rotary()
        for name in ("embed_scale", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UnsupportedModelError(
                    f"ModelSpec.{name} must be a positive finite number or None, got {value!r}."
                )

    def _check_rotary(self) -> None:
        rotary = self.rotary_dim
        if rotary is not None and not (isinstance(rotary, int) and 2 <= rotary <= self.head_dim and rotary % 2 == 0):
            raise UnsupportedModelError(
                f"ModelSpec.rotary_dim must be an even number of dims from 2 to head_dim ({self.head_dim}) or None, "
                f"got {rotary!r}."
            )
        if self.local_rope and len(self.local_rope) != self.num_layers:
            raise UnsupportedModelError(f"local_rope has {len(self.local_rope)} entries for {self.num_layers} layers.")
        if self.local_rope and self.positions != "rope":
            raise UnsupportedModelError(f"local_rope is set for a model with {self.positions} positions, not rotary.")
        limit = self.rope_max_positions
        if limit is not None and not (isinstance(limit, int) and limit >= 1):
            raise UnsupportedModelError(
                f"ModelSpec.rope_max_positions must be a positive integer or None, got {limit!r}."
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dims(self) -> int:
        """The dims of each head the rotary embedding turns (the first ones)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (1-based), or None for full attention."""
        if not 1 <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} is outside 1..{self.num_layers}")
        return self.sliding_windows[layer - 1] if self.sliding_windows else None

    def rope_table(self, layer: int) -> str:
        """The canonical prefix of layer `layer`'s rotary weights: "rope_local" where `local_rope` marks it, else "rope"
        (`rope.inv_freq`, and for the fused attention the tables `rope.cos` / `rope.sin`)."""
        if not 1 <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} is outside 1..{self.num_layers}")
        return "rope_local" if self.local_rope and self.local_rope[layer - 1] else "rope"

    @property
    def rope_tables(self) -> tuple[str, ...]:
        """Every rotary table's canonical prefix the layers read, each once."""
        if self.positions != "rope":
            return ()
        return tuple(dict.fromkeys(self.rope_table(layer) for layer in range(1, self.num_layers + 1)))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sliding_windows"] = list(self.sliding_windows)
        data["local_rope"] = list(self.local_rope)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UnsupportedModelError(f"unknown ModelSpec fields {sorted(unknown)}: written by a newer paradecode?")
        values = dict(data)
        values["sliding_windows"] = tuple(values.get("sliding_windows", ()))
        values["local_rope"] = tuple(values.get("local_rope", ()))
        return cls(**values)
