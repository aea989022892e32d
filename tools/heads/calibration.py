"""Thresholds for exit heads, and the exit layers worth using.

Per exit layer: the lowest threshold at which early tokens agree with the final ones at least at
the target rate. Then, with a cost model, the set of exit layers to give those thresholds: every
head a token passes costs a call, so using every calibrated layer is rarely best.

Choosing the set is a search over cascades, not over all 2^n subsets: a beam search by set size
(greedy forward selection that keeps the `SEARCH_WIDTH` cheapest sets of each size). From each
kept set it tries adding every other layer, scoring all n additions at once on the held-out
positions; it stops at the first size where no set beats the best one so far. That is at most
O(width · n² · positions) work for n exit layers. Plain greedy (width 1) sometimes settles for a
worse set when confidences are correlated across layers, as they are in real models; the beam
matched an exhaustive search on every synthetic case tried (tests/tools/test_heads.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paradecode.tools.heads.cost import CostModel

MIN_SUPPORT = 20  # a threshold needs at least this many held-out positions at or above it
SEARCH_WIDTH = 8  # sets of each size the layer search keeps; also the most sets `calibrate` reports


def layer_threshold(confidence: torch.Tensor, agree: torch.Tensor, target: float) -> tuple[float | None, dict]:
    """The lowest threshold whose early tokens agree at rate >= target on at least MIN_SUPPORT positions
    (None where there is none), and its report row."""
    conf, order = torch.sort(confidence, descending=True)
    hits = agree.gather(0, order).float()  # not agree[order]: advanced indexing is far slower on a busy CPU
    count = torch.arange(1, len(hits) + 1)
    precision = torch.cumsum(hits, 0) / count
    ok = torch.nonzero((precision >= target) & (count >= MIN_SUPPORT)).squeeze(1)
    if not len(ok):
        return None, {"threshold": None, "precision": None, "exit_rate": 0.0}
    cut = int(ok[-1])
    threshold = float(conf[cut])
    return threshold, {
        "threshold": round(threshold, 6),
        "precision": round(float(precision[cut]), 4),
        "exit_rate": round((cut + 1) / len(conf), 4),
    }


def ranking(total: float, layers: tuple[int, ...]) -> tuple:
    """Sort key for sets of exit layers: cheapest first; costs within 1e-9 layer-times are a tie, won by the
    smaller set (a layer that no token reaches costs nothing yet still ships a head)."""
    return round(total, 9), len(layers), layers


@dataclass(frozen=True)
class Cascade:
    """A set of exit layers (indices into the candidates, ascending) and what each position costs under it."""

    chosen: tuple[int, ...]
    first: np.ndarray  # [N] index of the candidate each position exits at; n where it exits nowhere
    costs: np.ndarray  # [N] float64 cost of each position, in layer-times


class LayerSearch:
    """Scores cascades of candidate exit layers on held-out positions, under a cost model.

    numpy, not torch: its element-wise work is single-threaded; on a busy 2-core CPU the same search
    in torch took 4-17 s against 0.14-0.29 s, its intra-op threads contending for the cores.
    """

    def __init__(self, cost: CostModel, layers: list[int], exits: np.ndarray, wrong: np.ndarray):
        self.cost, self.layers = cost, layers
        self.exits, self.wrong = exits, wrong  # [n, N] bool: clears the threshold; clears it yet disagrees
        self.index = np.arange(len(layers))[:, None]  # [n, 1]
        self.depth = np.asarray(layers, dtype=np.float64)

    def empty(self) -> Cascade:
        positions = self.exits.shape[1]
        return Cascade((), np.full(positions, len(self.layers)), np.full(positions, float(self.cost.through(0))))

    def exit_costs(self, cascade: Cascade) -> np.ndarray:
        """[n] cost of a token exiting at each candidate once it is added (before any rollback): the heads
        it calls are the cascade's layers below it and its own."""
        chosen = np.zeros(len(self.layers), dtype=np.int64)
        chosen[list(cascade.chosen)] = 1
        heads = np.cumsum(chosen) - chosen + 1
        return self.depth + heads * self.cost.head + self.cost.merge * (self.cost.num_layers - self.depth)

    def totals(self, cascade: Cascade) -> np.ndarray:
        """[n] expected cost per token of the cascade with each candidate added.

        Adding layer i changes only positions that reach it (those exiting above i or nowhere): the
        ones clearing its threshold now exit at i (plus the rollback where they disagree); the
        others call one head more on their way. Counted per candidate, without a cost per position.
        """
        reaches = cascade.first[None, :] > self.index  # [n, N]
        exiting = reaches & self.exits
        exits = np.count_nonzero(exiting, axis=1)
        change = (
            exits * self.exit_costs(cascade)
            + np.count_nonzero(reaches & self.wrong, axis=1) * self.cost.lost
            - np.where(exiting, cascade.costs, 0.0).sum(axis=1)  # what the positions now exiting at i cost before
            + (np.count_nonzero(reaches, axis=1) - exits) * self.cost.head
        )
        return (cascade.costs.sum() + change) / cascade.costs.size

    def added(self, cascade: Cascade, i: int) -> Cascade:
        """The cascade with candidate i added, with the cost of each position under it."""
        reaches = cascade.first > i
        exiting = reaches & self.exits[i]
        exit_cost = self.exit_costs(cascade)[i] + self.wrong[i] * self.cost.lost
        costs = np.where(exiting, exit_cost, np.where(reaches, cascade.costs + self.cost.head, cascade.costs))
        return Cascade(tuple(sorted((*cascade.chosen, i))), np.where(exiting, i, cascade.first), costs)

    def search(self) -> dict[tuple[int, ...], float]:
        """Expected cost per token of every set of layers the beam search evaluated."""
        evaluated: dict[tuple[int, ...], float] = {}
        beam, best = [self.empty()], self.cost.ar()
        for _ in self.layers:
            offers: dict[tuple[int, ...], tuple[float, Cascade, int]] = {}  # set -> (cost, cascade, layer added)
            for cascade in beam:
                for i, total in enumerate(self.totals(cascade).tolist()):
                    key = tuple(sorted((*cascade.chosen, i)))
                    if i not in cascade.chosen and key not in offers:
                        offers[key] = (total, cascade, i)
            ranked = sorted(offers.items(), key=lambda item: ranking(item[1][0], item[0]))
            evaluated.update((tuple(self.layers[i] for i in key), total) for key, (total, _, _) in ranked)
            if not ranked or ranking(ranked[0][1][0], ()) >= ranking(best, ()):
                break  # no set of this size beats the best so far: adding layers stops paying
            best = ranked[0][1][0]
            beam = [self.added(cascade, i) for _, (_, cascade, i) in ranked[:SEARCH_WIDTH]]
        return evaluated


def select_layers(
    cost: CostModel, confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], thresholds: dict[int, float]
) -> list[tuple[tuple[int, ...], float]]:
    """The sets of thresholded exit layers the search evaluated, with their expected speedup, best first."""
    layers = sorted(thresholds)
    if not layers:
        return []
    exits = np.stack([(confidence[e] >= thresholds[e]).cpu().numpy() for e in layers])
    wrong = exits & ~np.stack([agree[e].cpu().numpy() for e in layers])
    evaluated = LayerSearch(cost, layers, exits, wrong).search()
    ranked = sorted(evaluated.items(), key=lambda item: ranking(item[1], item[0]))
    return [(layers_used, cost.ar() / total) for layers_used, total in ranked]


def calibrate(
    confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], target: float, cost: CostModel | None = None
) -> dict[str, Any]:
    """Per exit layer, the lowest threshold whose early tokens agree with the final ones at rate >= target;
    then, with a cost model, the set of exit layers to use.

    `confidence[e]` is the head's top-1 probability and `agree[e]` whether its top-1 equals the final
    top-1, over the same held-out positions. A layer whose agreement never reaches the target on at
    least MIN_SUPPORT positions gets no threshold. With a cost model the set with the best expected
    speedup over plain decoding is selected (its layers keep their thresholds; the others get none,
    so their heads never run; none at all when no set is expected to beat plain decoding); without
    one every calibrated layer is used. Reports per layer the share of positions at or above its
    threshold, and, for the selection, the share exiting there first in the cascade the runtime runs.
    """
    calibrated: dict[int, float] = {}
    layers: dict[str, dict[str, Any]] = {}
    for e in sorted(confidence):
        threshold, layers[str(e)] = layer_threshold(confidence[e], agree[e], target)
        if threshold is not None:
            calibrated[e] = threshold
    ranked = select_layers(cost, confidence, agree, calibrated) if cost is not None else []
    if cost is None:
        chosen = tuple(sorted(calibrated))
    else:
        chosen = ranked[0][0] if ranked and ranked[0][1] > 1.0 else ()
    remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
    for e in sorted(confidence):
        row = layers[str(e)]
        row["selected"] = e in chosen
        exits = remaining & (confidence[e] >= calibrated[e]) if e in chosen else torch.zeros_like(remaining)
        row["cascade_exit_rate"] = round(float(exits.float().mean()), 4)
        row["cascade_precision"] = round(float((agree[e] & exits).sum() / exits.sum()), 4) if exits.any() else None
        remaining &= ~exits
    return {
        "target_agreement": target,
        "thresholds": {str(e): (calibrated[e] if e in chosen else None) for e in sorted(confidence)},
        "selected_layers": list(chosen),
        "expected_speedup": round(ranked[0][1], 4) if chosen and cost is not None else None,
        "cost_model": None
        if cost is None
        else {"head": round(cost.head, 4), "merge": cost.merge, "rollback": cost.lost},
        "subsets": [{"layers": list(s), "speedup": round(speedup, 4)} for s, speedup in ranked[:SEARCH_WIDTH]],
        "layers": layers,
        "positions": len(next(iter(confidence.values()))),
    }
