"""Sampling: the target distribution of a position, seeded draws, and the drafts that proposals were drawn from.

`distribution(logits, params)` turns a head's logits into the distribution a token is drawn from:
temperature first, then top-k, then top-p (Hugging Face's order), in float64. Plain decoding (`ar`)
draws each token from the final layer's distribution p.

ParaDecode keeps exactly that distribution with speculative rejection sampling (Leviathan et al.
2023; Chen et al. 2023; runtime/verification.py). A proposed token x was drawn from a distribution q: an
exit head's own (after the same temperature, top-k and top-p; zero outside a reduced vocabulary; drawn by
`Sampler.draw_exit`, which keeps q until x is verified) or, for a prompt-lookup proposal, the point mass
on x. Whether a token exits depends only on the head's confidence, never on which token was drawn, so the
verified sequence is distributed exactly as `ar` sampling.

Draws are counter-based: each comes from a generator keyed by (seed, position, purpose), so a seed
reproduces a run whatever order the lanes finish in, and `ar` and ParaDecode draw the same token at a
position where nothing was proposed. A key is used at most once in the surviving history: positions
are verified in order and a rollback discards only unverified positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Purposes of a draw at a position (part of its generator's key).
SAMPLE, PROPOSE, ACCEPT, RESAMPLE = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    """Validated by GenerationConfig. temperature > 0 (0 means greedy and never reaches here);
    top_k 0 = no limit; top_p 1.0 = no limit."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float64, summing to 1) of one position's logits [V] after temperature, top-k, top-p."""
    scores = logits.to(torch.float64) / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the more probable tokens
        drop = before >= params.top_p  # keep the smallest set whose mass reaches top_p (at least one token)
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs = probs / probs.sum()
    return probs


class Draws:
    """Seeded draws keyed by (position, purpose): reproducible whatever order they are made in."""

    def __init__(self, seed: int):
        self.seed = seed

    def generator(self, position: int, purpose: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, position, purpose])

    def uniform(self, position: int, purpose: int) -> float:
        return float(self.generator(position, purpose).random())

    def choice(self, probs: torch.Tensor, position: int, purpose: int) -> int:
        """An index drawn from `probs` (float64, summing to 1) by inverse CDF of one uniform."""
        u = self.uniform(position, purpose)
        cumulative = torch.cumsum(probs, 0)
        index = int(torch.searchsorted(cumulative, torch.tensor([u * float(cumulative[-1])], dtype=torch.float64)))
        index = min(index, probs.numel() - 1)
        while probs[index] == 0:  # never a token of probability 0 (rounding at a boundary)
            index -= 1
        return index


@dataclass
class Proposal:
    """The distribution a proposed token was drawn from: `probs` over `ids` (an exit head's support), or
    None for a point mass (a prompt-lookup proposal)."""

    ids: torch.Tensor | None = None  # int64 [N] token ids of the support (None: the whole vocabulary)
    probs: torch.Tensor | None = None  # float64 [N]

    def full(self, vocab_size: int) -> torch.Tensor:
        """q over the whole vocabulary."""
        if self.ids is None:
            return self.probs
        q = torch.zeros(vocab_size, dtype=torch.float64)
        q[self.ids] = self.probs
        return q


class Sampler:
    """A ParaDecode request's sampling: its parameters, its seeded draws, and the distribution q each exit token
    was drawn from (`drafts`, by the position the token follows), kept until the final layer verifies the token
    (runtime/verification.py takes it then; a rollback drops the ones it discards)."""

    def __init__(self, params: SamplingParams, exit_vocab: torch.Tensor | None):
        self.params = params
        self.draws = Draws(params.seed)
        self.exit_vocab = exit_vocab  # int64 [N]: the token ids of a trained exit head's reduced vocabulary
        self.drafts: dict[int, Proposal] = {}

    def draw_exit(self, position: int, logits: torch.Tensor, reduced: bool) -> int:
        """The token to follow `position`, drawn from an exit head's logits [V] ([N] over the reduced vocabulary
        when `reduced`) with the request's temperature, top-k and top-p; q is kept for its verification."""
        q = distribution(logits, self.params)
        index = self.draws.choice(q, position, PROPOSE)
        ids = self.exit_vocab if reduced else None
        self.drafts[position] = Proposal(ids, q)
        return int(ids[index]) if ids is not None else index

    def discard_from(self, position: int) -> None:
        """Drop the drafts keyed `position` and after: a rollback there discarded the tokens they were drawn for."""
        self.drafts = {q: draft for q, draft in self.drafts.items() if q < position}
