"""What a token costs under ParaDecode and under plain decoding: the one cost model of the project.

The speed calibration of `paradecode-train-heads` (`calibration.py`), `paradecode-bench`'s bound
(`tools/bench_modes.py`, `exit_bound`) and `paradecode-characterise`'s bound (docs/design.md §6) are this model with
different costs: measured call costs (`call_costs.CallCosts`), the idealised ones of docs/design.md §6
(`CostModel.bound`), or parameter counts (`CostModel.estimate`).

Units: one decoder layer call at T = 1 (one position). A token calls the head of every active exit layer
it reaches and exits at the first whose threshold its top-1 probability reaches; the next token then
starts at layer 1. What happens to the early token's upper layers depends on the overlap (docs/design.md §3;
runtime/decoding.py, runtime/overlaps.py):

- `batched` (one lane, the default on a CPU): when the next token reaches the early token's depth the two
  share one call per layer from there on, and one final head call. Every layer call's fixed part is paid
  by the newest token in it; each earlier position adds `merge`.
- `streams` (two lanes, perfect overlap): a side lane runs the early token's upper layers, one call each,
  while the next token runs its lower ones: the token costs the longer of the two.
- `both`: the upper layers merged as in `batched`, on a side lane as in `streams`.

So, per token:

    plain decoding:                 L + final + other
    exits after layer e (accepted): lower + upper + final_merge + other   (batched)
                                    max(lower, upper) + final_merge + other   (streams, both)
                                    lower = e + heads * head; upper = merge * (L - e), or L - e in streams
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
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from paradecode.export.heads.call_costs import CallCosts
from paradecode.export.heads.vocab import head_parameters, layer_parameters
from paradecode.graphs.errors import UserInputError
from paradecode.graphs.spec import ModelSpec
from paradecode.runtime.config import OVERLAPS as RUNTIME_OVERLAPS

OVERLAPS = tuple(o for o in RUNTIME_OVERLAPS if o != "auto")  # `auto` is one of them, chosen per device
MERGE_TOKENS = 2  # `merge` is measured from calls of this many positions: one early token and its successor


@dataclass(frozen=True)
class CostModel:
    """Decode cost per token in decoder-layer calls at T = 1 (see the module's docstring).

    `head`: one exit head call. `final`: the final head (None: the same as `head`, a head over the
    whole vocabulary). `merge`, `final_merge`: what one more position adds to a layer's or the final
    head's call. `other`: the rest of a token's work in either mode (its embedding). `rollback`: work
    lost per rejected early token (None: `ar()`). `overlap`: where an early token's upper layers run.
    `source`: where the numbers come from.
    """

    num_layers: int
    head: float
    merge: float = 0.1
    final: float | None = None
    final_merge: float = 0.0
    other: float = 0.0
    rollback: float | None = None
    overlap: str = "batched"
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
        if self.overlap not in OVERLAPS:
            raise UserInputError(f"the cost model's overlap must be one of {list(OVERLAPS)}, got {self.overlap!r}.")

    @classmethod
    def estimate(cls, spec: ModelSpec, exit_vocab: int | None = None) -> CostModel:
        """From parameter counts (a call reads its weights once): heads relative to a layer; merges assumed."""
        layer = layer_parameters(spec)
        final = spec.vocab_size * spec.hidden_size / layer
        head = head_parameters(spec, exit_vocab or spec.vocab_size) / layer
        return cls(spec.num_layers, head, merge=0.1, final=final, final_merge=0.1 * final, source="parameters")

    @classmethod
    def measured(cls, num_layers: int, costs: CallCosts, merge_tokens: int = MERGE_TOKENS) -> CostModel:
        """From timed calls (`call_costs.measure_call_costs`), in units of the measured layer call at T = 1;
        `merge` and `final_merge` from the calls of `merge_tokens` positions."""
        unit, k = costs.layer[1], merge_tokens
        return cls(
            num_layers,
            head=costs.exit_head / unit,
            merge=max(0.0, costs.layer[k] - unit) / (k - 1) / unit,
            final=costs.final_head[1] / unit,
            final_merge=max(0.0, costs.final_head[k] - costs.final_head[1]) / (k - 1) / unit,
            other=costs.embed / unit,
            source="measured",
        )

    @classmethod
    def bound(cls, num_layers: int, positions: int, overlap: str) -> CostModel:
        """docs/design.md §6's idealised costs: heads, embedding and final head free, and a merged position costing
        1/`positions` of a layer (a batched call of k positions costs one layer call)."""
        return cls(num_layers, head=0.0, merge=1 / positions, final=0.0, overlap=overlap, source="docs/design.md §6")

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

    def exit(self, layer, heads):
        """A token that exits after `layer`, having called `heads` heads there and below (before any rollback).
        Element-wise on numpy arrays (the calibration's search scores every candidate at once)."""
        lower = layer + heads * self.head
        upper = (self.num_layers - layer) * (1.0 if self.overlap == "streams" else self.merge)
        path = lower + upper if self.overlap == "batched" else np.maximum(lower, upper)
        return path + self.final_merge + self.other

    def through(self, heads: int) -> float:
        """A token that exits nowhere, having called `heads` exit heads: every layer and the final head."""
        return self.num_layers + heads * self.head + self.final_head + self.other

    def per_token(
        self, exits: Mapping[int, float], active: Collection[int], wrong: Mapping[int, float] | None = None
    ) -> float:
        """Expected cost per token when a share `exits[e]` of the tokens exits after layer e, every exit head of
        `active` running where a token reaches it, and a share `wrong[e]` of the tokens exits at e and is
        rejected (none where not given); the rest exit nowhere."""
        cost = 0.0
        for e, share in exits.items():
            cost += share * self.exit(e, sum(1 for a in active if a <= e))
            if wrong:
                cost += wrong.get(e, 0.0) * self.lost
        return cost + (1 - sum(exits.values())) * self.through(len(active))

    def speedup(
        self, exits: Mapping[int, float], active: Collection[int], wrong: Mapping[int, float] | None = None
    ) -> float:
        """Plain decoding's cost over `per_token`'s."""
        return self.ar() / self.per_token(exits, active, wrong)

    def paradecode(self, layers, confidence, agree, thresholds) -> float:
        """Expected cost per token on held-out positions when tokens exit at the first of `layers` whose
        threshold they reach (`confidence[e]`: the head's top-1 probability; `agree[e]`: whether its top-1 is
        the final layer's). The reference the calibration's search is tested against."""
        remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
        exits, wrong = {}, {}
        for e in sorted(layers):
            exiting = remaining & (confidence[e] >= thresholds[e])
            exits[e] = float(exiting.double().mean())
            wrong[e] = float((exiting & ~agree[e]).double().mean())
            remaining &= ~exiting
        return self.per_token(exits, layers, wrong)

    def as_dict(self) -> dict:
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return dict(rounded, final=round(self.final_head, 4), lost=round(self.lost, 4), ar=round(self.ar(), 4))
