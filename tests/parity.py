"""Token-for-token comparison of a decoded sequence with a reference, over the whole sequence.

docs/design.md §3: outputs may differ only where a batched product rounds differently from a single-token
one at a near tie of the top two logits. Such a divergence is reported (printed and warned), never
hidden, and the comparison does not stop there: every token of ours is checked against the reference
model's greedy choice *after ours' own prefix* (teacher forcing), so a wrong token anywhere, before
or after a near tie, fails; so does a wrong length.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import pytest
import torch

from paradecode.runtime import NEVER
from paradecode.tools.parity_report import scorer

NEAR_TIE = 1e-4  # logit margin below which float rounding may pick either token

# Every ParaDecode setting the parity tests run, one test each, as (threshold, overlap, max_unverified)
# with a readable id such as "t0-streams-K1". Threshold 0 makes every token exit (and untrained heads make
# nearly every one roll back: the stress test of pending layers and rollback), 0.5 some, never none.
THRESHOLDS = {"t0": 0.0, "t0.5": 0.5, "never": NEVER}
OVERLAPS = ("streams", "batched", "both")
MAX_UNVERIFIED = (1, 8)
SETTINGS = [
    pytest.param(threshold, overlap, k, id=f"{label}-{overlap}-K{k}")
    for (label, threshold), overlap, k in itertools.product(THRESHOLDS.items(), OVERLAPS, MAX_UNVERIFIED)
]

# score(sequence) -> (top-1 token, top-1/top-2 margin) after every position of `sequence`
Scorer = Callable[[list[int]], tuple[list[int], list[float]]]


def assert_same_tokens(
    ours: list[int], reference: list[int], what: str, *, prompt: list[int], score: Scorer, eos: tuple[int, ...] = ()
) -> list[str]:
    """Fail unless `ours` is the reference model's greedy decoding of `prompt`, up to near ties.

    Returns the near ties found (each also printed and warned). `reference` is the reference decoding;
    where it equals `ours` nothing more is needed. Otherwise each token of ours must be the greedy choice
    after ours' own prefix (`score`), or be a near tie there; and ours must be as long as the reference
    unless it ended at an EOS token (which a near tie may move).
    """
    if ours == reference:
        return []
    top1, margins = score(list(prompt) + list(ours))
    start = len(prompt) - 1
    ties = []
    for i, token in enumerate(ours):
        choice, margin = top1[start + i], margins[start + i]
        if token == choice:
            continue
        report = (
            f"{what}: new token {i} is {token}, the reference's greedy choice is {choice}, top-2 margin {margin:.2e}"
        )
        if margin >= NEAR_TIE:
            pytest.fail(report)
        ties.append(report)
        print("near tie:", report)
        warnings.warn(report, stacklevel=2)
    ended_at_eos = bool(ours) and ours[-1] in eos
    assert len(ours) == len(reference) or ended_at_eos, (
        f"{what}: {len(ours)} tokens, the reference has {len(reference)} (and ours did not end at an EOS token)"
    )
    return ties


def hf_scorer(model) -> Scorer:
    """Greedy choices and margins of a Hugging Face causal LM, one forward pass over the sequence."""

    def score(sequence: list[int]) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
        top = logits.topk(2, dim=-1).values
        return logits.argmax(-1).tolist(), (top[:, 0] - top[:, 1]).tolist()

    return score


def export_scorer(model) -> Scorer:
    """Greedy choices and margins of a loaded paradecode export (its own subgraphs, one prefill-like call
    per layer over the whole sequence, in a cache of its own)."""
    return scorer(model)
