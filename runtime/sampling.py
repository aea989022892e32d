"""Sampling: the target distribution of a position, seeded draws, and the drafts that proposals were drawn from.

`distribution(logits, params)` turns a head's logits into the distribution a token is drawn from:
temperature first, then top-k, then top-p (Hugging Face's order), in float64. Plain decoding (`ar`)
draws each token from the final layer's distribution p.

Draws are counter-based: each comes from a generator keyed by (seed, position, purpose), so a seed
reproduces a run whatever order the lanes finish in. ParaDecode keeps plain sampling's very draws: the final
layer's token after position q is the draw with the uniform keyed (seed, q, SAMPLE) in every mode, and a proposal
is accepted where it is that token (runtime/verification.py). An exit head's proposal is drawn from the head's own
distribution (after the same temperature, top-k and top-p; zero outside a reduced vocabulary) with that same
uniform (`Sampler.draw_exit`), so it is accepted where both draws land on one token; whether a token exits depends
only on the head's confidence, never on the draw. So `ar`, ParaDecode and a batch give a seed the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The purpose of a draw at a position (part of its generator's key): the token that follows the position.
SAMPLE = 0


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
    if not torch.isfinite(scores).all():
        # A temperature too small to divide by (below about 1e-307 for logits of ~20): the logits over it
        # overflow, to +inf or, where every logit is negative, -inf. Its limit is greedy, which the scores relative
        # to the largest give exactly: 0 there, -inf (or far below) elsewhere, so softmax is one-hot at the argmax
        # (shared among exact ties).
        scores = (logits.to(torch.float64) - logits.max().to(torch.float64)) / params.temperature
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


class Sampler:
    """A request's sampling: its parameters, its seeded draws, and the token ids of the exit heads' reduced
    vocabulary (where they have one)."""

    def __init__(self, params: SamplingParams, exit_vocab: torch.Tensor | None):
        self.params = params
        self.draws = Draws(params.seed)
        self.exit_vocab = exit_vocab  # int64 [N]: the token ids of a trained exit head's reduced vocabulary

    def draw_exit(self, position: int, logits: torch.Tensor, reduced: bool) -> int:
        """The token to follow `position`, drawn from an exit head's logits [V] ([N] over the reduced vocabulary
        when `reduced`) with the request's temperature, top-k and top-p and the uniform the final layer's draw there
        uses (over the whole vocabulary, in token order, so both draws land on one token where they agree)."""
        q = distribution(logits, self.params)
        if reduced:
            full = torch.zeros(int(self.exit_vocab.max()) + 1, dtype=torch.float64)
            full[self.exit_vocab] = q
            q = full
        return self.draws.choice(q, position, SAMPLE)
