"""The one cost model (`export/heads/cost_model.py`) behind bench's and characterise's bounds and the calibration.

The expected values below were computed, on these same inputs, by the three speedup models the cost model
replaced (bench's `exit_bound` over its own `CallCosts`, characterise's `bounds`, the calibration's
`CostModel` with `expected_speedup` and `calibrate`), and written here before they were replaced: the
refactor changed none of them beyond float rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

from paradecode.export.heads.calibration import calibrate, expected_speedup
from paradecode.export.heads.call_costs import CallCosts
from paradecode.export.heads.cost_model import CostModel
from paradecode.graphs.errors import UserInputError
from paradecode.tools import characterise
from paradecode.tools.bench_modes import exit_bound
from tests.export.heads.test_training import TINY_LAYER, spec_of

# bench's measurement: a layer 2 ms at T = 1 and 2.5 ms at T = 6 (K = 5), an exit head 0.8 ms, the final head 9 ms
BENCH_COSTS = CallCosts(
    layer={1: 2e-3, 6: 2.5e-3},
    exit_head=0.8e-3,
    final_head={1: 9e-3, 6: 12e-3},  # bench's bound charges every token the whole final head: T = 6 is not used
    embed=1e-4,  # nor the embedding
    exit_vocab=100,
    rounds=5,
    backend="onnxruntime CPU, 2 threads",
)
# calibration's measurement
CALIBRATION_COSTS = CallCosts(
    layer={1: 2e-3, 2: 2.2e-3, 4: 2.6e-3},
    exit_head=1e-3,
    final_head={1: 8e-3, 2: 9e-3, 4: 11e-3},
    embed=1e-4,
    exit_vocab=100,
    rounds=5,
    backend="onnxruntime CPU, 2 threads",
)


@pytest.mark.parametrize(
    ("accepted", "tokens", "num_layers", "active", "expected"),
    [
        ({"8": 30, "15": 10, "23": 25}, 200, 30, [8, 15, 23], 1.1171827565270187),
        ({"8": 30, "23": 25}, 200, 30, [8, 23], 1.1031615971861384),
        ({"8": 30, "15": 10}, 200, 30, [8], 1.0861010546198644),  # layer 15 is not active: its count is ignored
        ({}, 100, 30, [8, 23], 0.9773371104815863),  # nothing exits: every active head is pure cost
        ({"2": 64}, 64, 4, [2], 1.2142857142857144),
    ],
)
def test_bench_bound_is_unchanged(accepted, tokens, num_layers, active, expected):
    assert exit_bound(BENCH_COSTS, accepted, tokens, num_layers, active) == pytest.approx(expected, rel=1e-12)


BOUNDS = {  # (a, e, L, k) -> characterise's bounds per overlap
    (0.0, 2, 8, 6): (1.0, 1.0, 1.0),
    (0.0, 10, 30, 4): (1.0, 1.0, 1.0),
    (0.3, 2, 8, 6): (1.0810810810810811, 1.2307692307692308, 1.2903225806451615),
    (0.3, 4, 8, 6): (1.1764705882352942, 1.1428571428571428, 1.1764705882352942),
    (0.3, 10, 30, 4): (1.1111111111111112, 1.1764705882352942, 1.25),
    (0.5, 2, 8, 6): (1.1428571428571428, 1.4545454545454546, 1.6),
    (0.5, 4, 8, 6): (1.3333333333333333, 1.263157894736842, 1.3333333333333333),
    (0.5, 10, 30, 4): (1.2, 1.3333333333333333, 1.5),
    (1.0, 2, 8, 6): (1.3333333333333333, 2.6666666666666665, 4.0),
    (1.0, 4, 8, 6): (2.0, 1.7142857142857142, 2.0),
    (1.0, 10, 30, 4): (1.5, 2.0, 3.0),
}


@pytest.mark.parametrize(("case", "expected"), list(BOUNDS.items()), ids=[str(c) for c in BOUNDS])
def test_characterise_bounds_are_unchanged(case, expected):
    bounds = characterise.bounds(*case)
    assert list(bounds) == ["streams", "batched", "both"]
    assert list(bounds.values()) == pytest.approx(expected, rel=1e-12)


def test_characterise_bounds_are_the_cost_model_of_design_6():
    """Free heads, embedding and final head; a merged position costs 1/k of a layer."""
    a, e, layers, k = 0.4, 3, 12, 5
    for overlap, speedup in characterise.bounds(a, e, layers, k).items():
        model = CostModel.bound(layers, k, overlap)
        assert (model.head, model.final_head, model.other, model.merge) == (0.0, 0.0, 0.0, 1 / k)
        assert model.speedup({e: a}, [e]) == speedup


def held_out(seed: int = 3, positions: int = 500):
    g = torch.Generator().manual_seed(seed)
    confidence = {e: torch.rand(positions, generator=g) for e in (1, 2, 3)}
    agree = {e: (confidence[e] + 0.3 * torch.rand(positions, generator=g)) > 0.6 for e in confidence}
    return confidence, agree


def test_calibration_cost_model_from_measured_costs_is_unchanged():
    cost = CostModel.measured(4, CALIBRATION_COSTS)
    assert cost.as_dict() == {
        "num_layers": 4,
        "head": 0.5,
        "merge": 0.1,
        "final": 4.0,
        "final_merge": 0.5,
        "other": 0.05,
        "rollback": None,
        "overlap": "batched",
        "source": "measured",
        "lost": 8.05,
        "ar": 8.05,
    }


GIVEN = CostModel(num_layers=4, head=0.3, merge=0.1, final=2.0, final_merge=0.3, other=0.1, rollback=3.0)
SPEEDUPS = {  # (cost model, thresholds) -> expected_speedup on `held_out()`
    ("measured", ((1, 0.5), (2, 0.7))): 1.5569395057427096,
    ("measured", (("1", 0.9), ("3", 0.4))): 1.2670181699186691,
    ("measured", ((2, None),)): 1.0,
    ("measured", ((1, 0.2), (2, 0.5), (3, 0.8))): 1.5711915696184777,
    ("given", ((1, 0.5), (2, 0.7))): 1.5412603003941348,
    ("given", (("1", 0.9), ("3", 0.4))): 1.2389308541642405,
    ("given", ((2, None),)): 1.0,
    ("given", ((1, 0.2), (2, 0.5), (3, 0.8))): 1.823072315868216,
}


@pytest.mark.parametrize(("case", "expected"), list(SPEEDUPS.items()), ids=[str(c) for c in SPEEDUPS])
def test_calibration_expected_speedup_is_unchanged(case, expected):
    """Within float32 rounding: the shares of positions were float32 means, they are float64 now."""
    which, thresholds = case
    cost = CostModel.measured(4, CALIBRATION_COSTS) if which == "measured" else GIVEN
    confidence, agree = held_out()
    assert expected_speedup(cost, confidence, agree, dict(thresholds)) == pytest.approx(expected, rel=1e-6)


def test_calibration_choice_is_unchanged():
    confidence, agree = held_out()
    result = calibrate(confidence, agree, CostModel.measured(4, CALIBRATION_COSTS))
    assert result["thresholds"] == {"1": 0.45, "2": 0.55, "3": 0.4} and result["selected_layers"] == [1, 2, 3]
    assert result["expected_speedup"] == 1.9775
    assert result["expected_exits"] == {"exit_rate": 0.922, "accepted_rate": 0.874}
    assert [(s["thresholds"], s["speedup"]) for s in result["subsets"]] == [
        ([0.45, 0.55, 0.4], 1.9775),
        ([0.45, 0.55, 0.45], 1.9746),
        ([0.45, 0.55, 0.5], 1.9689),
        ([0.45, 0.5, 0.4], 1.9607),
        ([0.45, 0.55, 0.35], 1.9599),
        ([0.45, 0.5, 0.45], 1.9585),
        ([0.45, 0.5, 0.5], 1.9571),
        ([0.45, 0.45, 0.45], 1.9565),
    ]
    result = calibrate(confidence, agree, GIVEN)
    assert result["thresholds"] == {"1": 0.35, "2": 0.3, "3": 0.4} and result["expected_speedup"] == 1.9703


def test_the_three_uses_agree_where_their_assumptions_do():
    """One model: the calibration's expected speedup of a choice equals the bound of the same shares when the
    model charges nothing for rollbacks and every exit is right."""
    confidence, agree = held_out()
    right = {e: torch.ones_like(a) for e, a in agree.items()}
    cost = CostModel.measured(4, CALIBRATION_COSTS)
    thresholds = {1: 0.5, 3: 0.7}
    remaining, shares = torch.ones(500, dtype=torch.bool), {}
    for e in sorted(thresholds):
        exits = remaining & (confidence[e] >= thresholds[e])
        shares[e] = float(exits.double().mean())
        remaining &= ~exits
    assert expected_speedup(cost, confidence, right, thresholds) == pytest.approx(
        cost.speedup(shares, thresholds), rel=1e-12
    )


def test_an_overlap_outside_the_bounded_ones_is_refused():
    with pytest.raises(UserInputError, match=r"overlap must be one of \['streams', 'batched', 'both'\], got 'auto'"):
        CostModel(num_layers=4, head=0.5, overlap="auto")


def test_a_streams_exit_waits_for_the_slower_lane():
    """Two lanes, perfect overlap: an exit costs the longer of the lower layers with their heads and the upper
    layers one call each (no merging), plus the merged final head and the embedding."""
    model = CostModel(num_layers=10, head=0.5, merge=0.1, final=2.0, final_merge=0.2, other=0.1, overlap="streams")
    assert model.exit(3, 1) == pytest.approx(max(3 + 0.5, 7) + 0.2 + 0.1)
    assert model.exit(8, 2) == pytest.approx(max(8 + 1.0, 2) + 0.2 + 0.1)
    both = CostModel(num_layers=10, head=0.5, merge=0.1, final=2.0, final_merge=0.2, other=0.1, overlap="both")
    assert both.exit(3, 1) == pytest.approx(max(3 + 0.5, 0.7) + 0.2 + 0.1)


# --- from measured call costs, by hand, and from a spec's parameters ----------------------------------------


def test_cost_model_from_measured_call_costs_by_hand():
    costs = CALIBRATION_COSTS
    _, spec = spec_of("llama")
    cost = CostModel.measured(spec.num_layers, costs)
    assert (cost.head, cost.final, cost.other) == pytest.approx((0.5, 4.0, 0.05))
    assert (cost.merge, cost.final_merge) == pytest.approx((0.1, 0.5))  # from the T = 2 calls
    assert cost.ar() == pytest.approx(4 + 4.0 + 0.05) and cost.lost == cost.ar()
    json.dumps(costs.as_dict())


def test_cost_model_charges_every_head_passed_and_every_rollback():
    """Four positions by hand: L = 4, head 0.5, merge 0.1, final 2, final merge 0.3, embedding 0.2,
    rollback = ar = 4 + 2 + 0.2 = 6.2."""
    cost = CostModel(num_layers=4, head=0.5, merge=0.1, final=2.0, final_merge=0.3, other=0.2)
    confidence = {1: torch.tensor([0.9, 0.9, 0.1, 0.1]), 2: torch.tensor([0.9, 0.1, 0.9, 0.1])}
    agree = {1: torch.tensor([True, False, True, True]), 2: torch.ones(4, dtype=torch.bool)}
    # exits at 1, right: 1 + 0.5 + 0.3 + 0.3 + 0.2 = 2.3; at 1, wrong: the same + 6.2;
    # at 2 after two heads: 2 + 1 + 0.2 + 0.3 + 0.2 = 3.7; nowhere: 4 layers + 2 exit heads + final + 0.2 = 7.2
    expected = (2.3 + 8.5 + 3.7 + 7.2) / 4
    assert cost.paradecode((1, 2), confidence, agree, {1: 0.5, 2: 0.5}) == pytest.approx(expected)
    assert cost.paradecode((2, 1), confidence, agree, {1: 0.5, 2: 0.5}) == pytest.approx(expected)
    assert cost.ar() == pytest.approx(6.2) and cost.lost == pytest.approx(6.2)
    assert CostModel(num_layers=4, head=0.5, rollback=1.0).lost == 1.0
    assert CostModel(num_layers=4, head=0.5).final_head == 0.5  # no final head given: a full-vocabulary head


def test_cost_model_estimate_and_validation():
    _, spec = spec_of("llama")
    estimate = CostModel.estimate(spec, exit_vocab=38)
    assert estimate.num_layers == 4 and estimate.source == "parameters"
    assert estimate.head == pytest.approx((38 * 48 + 48 * 48) / TINY_LAYER)
    assert estimate.final == pytest.approx(97 * 48 / TINY_LAYER)
    with pytest.raises(UserInputError, match=r"head must be .* >= 0, got -0.5"):
        CostModel(num_layers=4, head=-0.5)
    with pytest.raises(UserInputError, match="merge must be .* got nan"):
        CostModel(num_layers=4, head=0.5, merge=float("nan"))
    with pytest.raises(UserInputError, match="num_layers >= 1, got 0"):
        CostModel(num_layers=0, head=0.5)
