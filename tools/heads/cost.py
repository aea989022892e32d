"""What an exit layer costs and saves: the decode cost model that picks the exit layers to use."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paradecode.graphs.errors import UserInputError


@dataclass(frozen=True)
class CostModel:
    """Decode cost per token in units of one decoder layer, for choosing which exit layers to use.

    The runtime's cascade (DESIGN.md §3): a token calls the head of every used exit layer it
    reaches and exits at the first whose threshold it clears. `head`: one exit (or final) head,
    relative to a layer: about vocab * d / (layer parameters) when reading weights dominates, never
    below `min_head` (a call has a fixed cost). `merge`: what a pending position adds to a later
    token's batched call, per skipped layer. `rollback`: work lost per rejected early token.
    """

    num_layers: int
    head: float
    merge: float = 0.1
    rollback: float | None = None  # default: num_layers (about one token's worth of work)
    min_head: float = 0.25

    def __post_init__(self) -> None:
        if not (isinstance(self.num_layers, int) and self.num_layers >= 1):
            raise UserInputError(f"a cost model needs num_layers >= 1, got {self.num_layers!r}.")
        for name in ("head", "merge", "rollback", "min_head"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UserInputError(
                    f"the cost model's {name} must be a finite number of layer-times >= 0, got {value!r}"
                    f"{' (--head-cost)' if name == 'head' else ''}."
                )

    @classmethod
    def estimate(cls, spec) -> CostModel:
        d, ffn = spec.hidden_size, spec.intermediate_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        layer = d * (2 * q + 2 * kv) + (3 if spec.mlp == "gated" else 2) * d * ffn
        return cls(spec.num_layers, max(cls.min_head, (spec.vocab_size * d + d * d) / layer))

    @property
    def lost(self) -> float:
        """Work lost when an early token is rejected."""
        return self.rollback if self.rollback is not None else self.num_layers

    def ar(self) -> float:
        """Plain decoding: every layer and the final head."""
        return self.num_layers + self.head

    def exit(self, layer: int, heads: int) -> float:
        """A token that exits after `layer`, having called `heads` heads there and below (before any rollback)."""
        return layer + heads * self.head + self.merge * (self.num_layers - layer)

    def through(self, heads: int) -> float:
        """A token that exits nowhere, having called `heads` exit heads: every layer and the final head."""
        return self.num_layers + (heads + 1) * self.head

    def paradecode(self, layers: tuple[int, ...], confidence, agree, thresholds) -> float:
        """Expected cost per token when tokens exit at the first of `layers` whose threshold they reach."""
        remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
        cost, heads = 0.0, 0
        for e in sorted(layers):
            heads += 1
            exits = remaining & (confidence[e] >= thresholds[e])
            rate = float(exits.float().mean())
            wrong = float((exits & ~agree[e]).sum() / exits.sum()) if exits.any() else 0.0
            cost += rate * (self.exit(e, heads) + wrong * self.lost)
            remaining &= ~exits
        return cost + float(remaining.float().mean()) * self.through(heads)
