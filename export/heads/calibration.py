"""Exit layers and thresholds that maximise the expected decoding speed.

The objective is the cost model's expected cost per token (`export/heads/cost_model.py`: measured call costs,
the runtime's cascade, rollbacks), over held-out positions where each head's top-1 probability and
whether its top-1 is the final layer's are known. Not a fixed precision: a low threshold exits
often and is rejected often, a high one rarely does either, and which pays depends on how deep the
layer is and what its head and a rollback cost.

A *candidate* is an exit layer with a threshold from GRID (one that at least MIN_SUPPORT held-out
positions reach, so that its rates are measured, not guessed). A choice is a set of candidates, at
most one per layer. The search is over cascades, not over all (|GRID| + 1)^n choices: a beam
search by set size (greedy forward selection keeping the SEARCH_WIDTH cheapest sets of each size).
From each kept set it tries adding every candidate of every other layer, scoring all additions at
once; it stops at the first size where no set beats the best one so far. Then the best set's
thresholds are refined one layer at a time over the grid (dropping the layer is one option), until
no change helps: a layer's best threshold depends on the layers below it, which the forward
selection may add after it. Work: O(width · n² · |GRID| · positions) for n exit layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paradecode.export.heads.cost_model import CostModel

GRID = (*[round(0.05 * i, 2) for i in range(2, 20)], 0.97, 0.99)  # 0.10, 0.15, ..., 0.95, 0.97, 0.99
MIN_SUPPORT = 20  # a candidate threshold needs at least this many held-out positions at or above it
SEARCH_WIDTH = 8  # sets of each size the search keeps; also the most sets `calibrate` reports
REFINE_ROUNDS = 10


@dataclass(frozen=True)
class Candidates:
    """Exit options, sorted by layer then threshold, with what each does on the held-out positions."""

    layer: np.ndarray  # [C] int64
    threshold: np.ndarray  # [C] float64
    exits: np.ndarray  # [C, N] bool: the position's head is at least this confident there
    wrong: np.ndarray  # [C, N] bool: ... yet its top-1 is not the final layer's


def candidates_of(confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], grid) -> Candidates:
    layers, thresholds, exits, wrong = [], [], [], []
    for e in sorted(confidence):
        conf, hit = confidence[e].cpu().numpy(), agree[e].cpu().numpy()
        for threshold in sorted(grid):
            clears = conf >= threshold
            if np.count_nonzero(clears) >= MIN_SUPPORT:
                layers.append(e)
                thresholds.append(float(threshold))
                exits.append(clears)
                wrong.append(clears & ~hit)
    positions = len(next(iter(confidence.values())))
    empty = np.zeros((0, positions), dtype=bool)
    return Candidates(
        np.asarray(layers, dtype=np.int64),
        np.asarray(thresholds, dtype=np.float64),
        np.stack(exits) if exits else empty,
        np.stack(wrong) if wrong else empty,
    )


def ranking(total: float, chosen: tuple[int, ...]) -> tuple:
    """Sort key for choices: cheapest first; costs within 1e-9 layer-times are a tie, won by the smaller set
    (a layer that no token reaches costs nothing yet still ships a head)."""
    return round(total, 9), len(chosen), chosen


@dataclass(frozen=True)
class Cascade:
    """A set of candidates (indices, ascending) and what each position costs under it."""

    chosen: tuple[int, ...]
    first: np.ndarray  # [N] index of the candidate each position exits at; C where it exits nowhere
    costs: np.ndarray  # [N] float64 cost of each position, in layer-times

    @property
    def total(self) -> float:
        return float(self.costs.mean())


class LayerSearch:
    """Scores cascades of candidates on held-out positions, under a cost model.

    numpy, not torch: its element-wise work is single-threaded; on a busy 2-core CPU the same search
    in torch took 4-17 s against 0.14-0.29 s, its intra-op threads contending for the cores.
    """

    def __init__(self, cost: CostModel, candidates: Candidates):
        self.cost, self.c = cost, candidates
        self.index = np.arange(len(candidates.layer))[:, None]  # [C, 1]
        self.depth = candidates.layer.astype(np.float64)

    def empty(self) -> Cascade:
        positions = self.c.exits.shape[1]
        return Cascade((), np.full(positions, len(self.c.layer)), np.full(positions, float(self.cost.through(0))))

    def exit_costs(self, cascade: Cascade) -> np.ndarray:
        """[C] cost of a token exiting at each candidate once it is added (before any rollback): the heads it
        calls are the cascade's layers below it and its own."""
        below = np.searchsorted(np.sort(self.c.layer[list(cascade.chosen)]), self.c.layer, side="left")
        return self.cost.exit(self.depth, below + 1)

    def totals(self, cascade: Cascade) -> np.ndarray:
        """[C] expected cost per token of the cascade with each candidate added (inf: its layer is in it already).

        Adding candidate i changes only positions that reach it (those exiting above its layer or
        nowhere): the ones clearing its threshold now exit there (plus the rollback where they
        disagree); the others call one head more on their way.
        """
        reaches = cascade.first[None, :] > self.index  # [C, N]
        exiting = reaches & self.c.exits
        exits = np.count_nonzero(exiting, axis=1)
        change = (
            exits * self.exit_costs(cascade)
            + np.count_nonzero(reaches & self.c.wrong, axis=1) * self.cost.lost
            - exiting.astype(np.float64) @ cascade.costs  # what the positions now exiting there cost before
            + (np.count_nonzero(reaches, axis=1) - exits) * self.cost.head
        )
        totals = (cascade.costs.sum() + change) / cascade.costs.size
        taken = np.isin(self.c.layer, self.c.layer[list(cascade.chosen)])
        return np.where(taken, np.inf, totals)

    def added(self, cascade: Cascade, i: int) -> Cascade:
        """The cascade with candidate i added (its layer not in it yet), with the cost of each position under it."""
        reaches = cascade.first > i
        exiting = reaches & self.c.exits[i]
        below = sum(1 for j in cascade.chosen if self.c.layer[j] < self.c.layer[i])  # heads called on the way
        exit_cost = self.cost.exit(float(self.depth[i]), below + 1) + self.c.wrong[i] * self.cost.lost
        costs = np.where(exiting, exit_cost, np.where(reaches, cascade.costs + self.cost.head, cascade.costs))
        return Cascade(tuple(sorted((*cascade.chosen, i))), np.where(exiting, i, cascade.first), costs)

    def build(self, chosen) -> Cascade:
        cascade = self.empty()
        for i in chosen:
            cascade = self.added(cascade, i)
        return cascade

    def search(self) -> dict[tuple[int, ...], float]:
        """Expected cost per token of every set of candidates the beam search evaluated."""
        evaluated: dict[tuple[int, ...], float] = {}
        beam, best = [self.empty()], self.cost.ar()
        for _ in range(len(set(self.c.layer.tolist()))):
            offers: dict[tuple[int, ...], tuple[float, Cascade, int]] = {}  # set -> (cost, cascade, candidate added)
            for cascade in beam:
                totals = np.round(self.totals(cascade), 9)
                # Only a cascade's SEARCH_WIDTH cheapest additions (ties included) can be among the SEARCH_WIDTH
                # cheapest sets of this size overall, so only those are keyed and ranked.
                finite = np.isfinite(totals)
                if not finite.any():
                    continue
                cut = np.partition(totals[finite], min(SEARCH_WIDTH, int(finite.sum())) - 1)[
                    min(SEARCH_WIDTH, int(finite.sum())) - 1
                ]
                for i in np.nonzero(finite & (totals <= cut))[0].tolist():
                    key = tuple(sorted((*cascade.chosen, i)))
                    if key not in offers:
                        offers[key] = (float(totals[i]), cascade, i)
            ranked = sorted(offers.items(), key=lambda item: ranking(item[1][0], item[0]))
            evaluated.update((key, total) for key, (total, _, _) in ranked)
            if not ranked or ranking(ranked[0][1][0], ()) >= ranking(best, ()):
                break  # no set of this size beats the best so far: adding layers stops paying
            best = ranked[0][1][0]
            beam = [self.added(cascade, i) for _, (_, cascade, i) in ranked[:SEARCH_WIDTH]]
        return evaluated

    def refine(self, chosen: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
        """Improve a choice one layer at a time: each chosen layer's best threshold (or none) given the others."""
        best = self.build(chosen).total
        for _ in range(REFINE_ROUNDS):
            improved = False
            for layer in sorted({int(self.c.layer[i]) for i in chosen}):
                others = tuple(i for i in chosen if self.c.layer[i] != layer)
                base = self.build(others)  # candidates add in any order: each option is one step from it
                for option in [None, *np.nonzero(self.c.layer == layer)[0].tolist()]:
                    trial = tuple(sorted(others + ((option,) if option is not None else ())))
                    total = (base if option is None else self.added(base, option)).total
                    if ranking(total, trial) < ranking(best, chosen):
                        chosen, best, improved = trial, total, True
            if not improved:
                break
        return chosen, best


def calibrate(
    confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], cost: CostModel, grid=GRID
) -> dict[str, Any]:
    """The exit layers and thresholds with the best expected speedup over plain decoding, and the report.

    `confidence[e]` is the head's top-1 probability and `agree[e]` whether its top-1 equals the final
    top-1, over the same held-out positions. The chosen layers get their thresholds; the others get
    none (their heads never run); no layer gets one when no choice is expected to beat plain decoding.
    """
    candidates = candidates_of(confidence, agree, grid)
    search = LayerSearch(cost, candidates)
    evaluated = search.search()
    ranked = sorted(evaluated.items(), key=lambda item: ranking(item[1], item[0]))
    best, best_total = search.refine(ranked[0][0]) if ranked else ((), cost.ar())
    chosen = best if ranking(best_total, best) < ranking(cost.ar(), ()) else ()
    thresholds = {int(candidates.layer[i]): float(candidates.threshold[i]) for i in chosen}
    total = search.build(chosen).total

    def described(choice: tuple[int, ...], total: float) -> dict[str, Any]:
        return {
            "layers": [int(candidates.layer[i]) for i in choice],
            "thresholds": [float(candidates.threshold[i]) for i in choice],
            "speedup": round(cost.ar() / total, 4),
        }

    layers: dict[str, dict[str, Any]] = {}
    remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
    accepted = torch.zeros_like(remaining)
    for e in sorted(confidence):
        alone = [i for i in range(len(candidates.layer)) if candidates.layer[i] == e]
        alone_best = min(alone, key=lambda i: search.build((i,)).total, default=None)
        row: dict[str, Any] = {
            "threshold": thresholds.get(e),
            "selected": e in thresholds,
            "alone": None if alone_best is None else described((alone_best,), search.build((alone_best,)).total),
        }
        clears = confidence[e] >= thresholds[e] if e in thresholds else torch.zeros_like(remaining)
        exits = remaining & clears
        row["exit_rate"] = round(float(clears.float().mean()), 4)
        row["precision"] = round(float((agree[e] & clears).sum() / clears.sum()), 4) if clears.any() else None
        row["cascade_exit_rate"] = round(float(exits.float().mean()), 4)
        row["cascade_precision"] = round(float((agree[e] & exits).sum() / exits.sum()), 4) if exits.any() else None
        remaining &= ~exits
        accepted |= agree[e] & exits
        layers[str(e)] = row
    return {
        "objective": "expected speed",
        "thresholds": {str(e): thresholds.get(e) for e in sorted(confidence)},
        "selected_layers": sorted(thresholds),
        "expected_speedup": round(cost.ar() / total, 4),
        "expected_exits": {  # per token: the share that exits early, and the share that exits and is accepted
            "exit_rate": round(float((~remaining).float().mean()), 4),
            "accepted_rate": round(float(accepted.float().mean()), 4),
        },
        "best_found": described(best, best_total),
        "cost_model": cost.as_dict(),
        "subsets": [described(choice, t) for choice, t in ranked[:SEARCH_WIDTH]],
        "layers": layers,
        "positions": len(next(iter(confidence.values()))),
        "grid": list(grid),
    }


def expected_speedup(
    cost: CostModel, confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], thresholds: dict
) -> float:
    """The cost model's speedup of a choice (thresholds by layer as strings or ints; None: not used) on positions."""
    used = {int(e): t for e, t in thresholds.items() if t is not None}
    if not used:
        return 1.0
    return cost.ar() / cost.paradecode(tuple(used), confidence, agree, used)
