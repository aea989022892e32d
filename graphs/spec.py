"""`ModelSpec`: everything the subgraph modules need to know about a decoder-only model.

A spec is family-neutral: each supported architecture is described by the features it uses
(norm kind, MLP kind, biases, q/k norm, position kind, sliding windows). The exporter's family
adapters build a spec from a Hugging Face config; the manifest stores it; the runtime rebuilds the
torch modules from it without transformers.
"""

from __future__ import annotations

import dataclasses
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

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (1-based), or None for full attention."""
        if not 1 <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} is outside 1..{self.num_layers}")
        return self.sliding_windows[layer - 1] if self.sliding_windows else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sliding_windows"] = list(self.sliding_windows)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UnsupportedModelError(f"unknown ModelSpec fields {sorted(unknown)}: written by a newer paradecode?")
        values = dict(data)
        values["sliding_windows"] = tuple(values.get("sliding_windows", ()))
        return cls(**values)
