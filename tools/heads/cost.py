"""What a token costs under ParaDecode and under plain decoding: the model the speed calibration maximises.

Units: one decoder layer call at T = 1 (one position). The runtime's semantics on one lane with
`batched` overlap, the default on a CPU (DESIGN.md §3; runtime/scheduler.py): a token calls the
head of every active exit layer it reaches and exits at the first whose threshold its top-1
probability reaches; the next token then starts at layer 1, and when it reaches the early token's
depth the two share one call per layer from there on, and one final head call. Every layer call's
fixed part is paid by the newest token in it; each earlier position adds `merge`. So, per token:

    plain decoding:                 L + final + other
    exits after layer e (accepted): e + heads * head + merge * (L - e) + final_merge + other
    exits nowhere:                  L + heads * head + final + other
    exits after layer e, rejected:  the accepted cost + `lost`

`heads`: the exit heads it called (every active exit layer up to e). `lost`: a rejection discards
what was computed for the later tokens before the verdict, which on the critical path is about one
token's pass through every layer and the final head (the successor's lower layers, then the shared
calls above e): `ar()`, unless `rollback` says otherwise. Left out: the K limit on unverified tokens
(at most K tokens exit in a row), the scheduler's own per-token overhead, and that a call of T > 2
positions costs a little more or less than the linear `merge` says.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.spec import ModelSpec
from paradecode.tools.heads.timing import CallCosts
from paradecode.tools.heads.vocab import head_parameters, layer_parameters

MERGE_TOKENS = 2  # `merge` is measured from calls of this many positions: one early token and its successor


@dataclass(frozen=True)
class CostModel:
    """Decode cost per token in decoder-layer calls at T = 1 (see the module's docstring).

    `head`: one exit head call. `final`: the final head (None: the same as `head`, a head over the
    whole vocabulary). `merge`, `final_merge`: what one more position adds to a layer's or the final
    head's call. `other`: the rest of a token's work in either mode (its embedding). `rollback`: work
    lost per rejected early token (None: `ar()`). `source`: where the numbers come from.
    """

    num_layers: int
    head: float
    merge: float = 0.1
    final: float | None = None
    final_merge: float = 0.0
    other: float = 0.0
    rollback: float | None = None
    source: str = "given"

    def __post_init__(self) -> None:
        if not (isinstance(self.num_layers, int) and self.num_layers >= 1):
            raise UserInputError(f"a cost model needs num_layers >= 1, got {self.num_layers!r}.")
        for name in ("head", "merge", "final", "final_merge", "other", "rollback"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UserInputError(
                    f"the cost model's {name} must be a finite number of layer-times >= 0, got {value!r}."
                )

    @classmethod
    def estimate(cls, spec: ModelSpec, exit_vocab: int | None = None) -> CostModel:
        """From parameter counts (a call reads its weights once): heads relative to a layer; merges assumed."""
        layer = layer_parameters(spec)
        final = spec.vocab_size * spec.hidden_size / layer
        head = head_parameters(spec, exit_vocab or spec.vocab_size) / layer
        return cls(spec.num_layers, head, merge=0.1, final=final, final_merge=0.1 * final, source="parameters")

    @classmethod
    def measured(cls, spec: ModelSpec, costs: CallCosts) -> CostModel:
        """From timed calls (`timing.measure_call_costs`), in units of the measured layer call at T = 1."""
        unit, k = costs.layer[1], MERGE_TOKENS
        return cls(
            spec.num_layers,
            head=costs.exit_head / unit,
            merge=max(0.0, costs.layer[k] - unit) / (k - 1) / unit,
            final=costs.final_head[1] / unit,
            final_merge=max(0.0, costs.final_head[k] - costs.final_head[1]) / (k - 1) / unit,
            other=costs.embed / unit,
            source="measured",
        )

    @property
    def final_head(self) -> float:
        return self.head if self.final is None else self.final

    @property
    def lost(self) -> float:
        """Work lost when an early token is rejected."""
        return self.rollback if self.rollback is not None else self.ar()

    def ar(self) -> float:
        """Plain decoding: every layer and the final head."""
        return self.num_layers + self.final_head + self.other

    def exit(self, layer: float, heads: float) -> float:
        """A token that exits after `layer`, having called `heads` heads there and below (before any rollback)."""
        return layer + heads * self.head + self.merge * (self.num_layers - layer) + self.final_merge + self.other

    def through(self, heads: int) -> float:
        """A token that exits nowhere, having called `heads` exit heads: every layer and the final head."""
        return self.num_layers + heads * self.head + self.final_head + self.other

    def as_dict(self) -> dict:
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return dict(rounded, final=round(self.final_head, 4), lost=round(self.lost, 4), ar=round(self.ar(), 4))

    def paradecode(self, layers, confidence, agree, thresholds) -> float:
        """Expected cost per token when tokens exit at the first of `layers` whose threshold they reach.

        The reference the calibration's search is tested against: plain, position by position.
        """
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
