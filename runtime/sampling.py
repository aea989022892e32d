"""Sampling: the target distribution of a position, seeded draws, and lossless verification of proposals.

`distribution(logits, params)` turns a head's logits into the distribution a token is drawn from:
temperature first, then top-k, then top-p (Hugging Face's order), in float64. Plain decoding (`ar`)
draws each token from the final layer's distribution p.

ParaDecode keeps exactly that distribution with speculative rejection sampling (Leviathan et al.
2023; Chen et al. 2023). A proposed token x was drawn from a distribution q: an exit head's own
(after the same temperature, top-k and top-p; zero outside a reduced vocabulary) or, for a prompt-
lookup proposal, the point mass on x. When the final layer gives p at that position, x is accepted
with probability min(1, p(x)/q(x)); otherwise the position draws from normalise(max(0, p - q)) and
everything after it is rolled back. Whether a token exits depends only on the head's confidence,
never on which token was drawn, so the verified sequence is distributed exactly as `ar` sampling.

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


def verify(p: torch.Tensor, token: int, proposal: Proposal | None, position: int, draws: Draws) -> tuple[bool, int]:
    """Verify proposed `token` at `position` against the target p; (accepted, the token the position keeps)."""
    if proposal is None or proposal.probs is None:  # a point mass on `token`
        if draws.uniform(position, ACCEPT) < float(p[token]):
            return True, token
        residual = p.clone()
        residual[token] = 0.0
    else:
        q = proposal.full(p.numel())  # q(token) > 0: the token was drawn from q
        if draws.uniform(position, ACCEPT) < min(1.0, float(p[token] / q[token])):
            return True, token
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    if total <= 0:  # p == q: acceptance was certain; kept for safety against rounding
        return True, token
    return False, draws.choice(residual / total, position, RESAMPLE)
