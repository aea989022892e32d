"""Verification: the final layer's verdict on proposed tokens, greedy or by rejection sampling (docs/design.md §3.4).

One function, `verify`, for both, in the shape of vLLM's rejection sampler: given the proposed tokens and the
target's outputs at their positions, it returns how many proposals are accepted and the token that follows them.

Glossary
--------
group        positions start .. end - 1, consecutive, on which the final head has just run (T = end - start).
target       the final head's output there (`HeadOutput`): `token` [T], its top-1 per position, and, when sampling,
             `logits` [T, V]. Index i is position start + i.
proposed     tokens[q + 1] for a group position q, where it exists: the token proposed to follow q (an exit token or
             a lookup proposal), not verified yet. Only the group's last position may have none: the newest token.
p            sampling: distribution(target.logits[i]) [V], float64: what plain sampling draws q's successor from.
draft q      sampling: the distribution a proposed token was drawn from, a `Proposal`: an exit head's, probs [N] over
             ids [N] (N = V without a reduced vocabulary), kept in `Sampler.drafts` by position until used here; for
             a lookup proposal, none: the point mass on the token.
accepted     the number of proposals accepted, in order, before the first rejection.
next token   what follows the accepted proposals. On a rejection: greedy, the target's top-1; sampling, a draw from
             the residual normalise(max(0, p - q)). When every proposal was accepted and the group's last position
             had none (`bonus`): the target's own token there (its top-1, or a draw from p). Otherwise None.

Greedy, a proposal is accepted when it is the target's top-1, so the output is plain decoding's. Sampling, proposed x
is accepted with probability min(1, p(x)/q(x)) (Leviathan et al. 2023; Chen et al. 2023), which keeps every
position distributed exactly as plain sampling draws it. Draws are keyed by (seed, position, purpose)
(runtime/sampling.py), so a verdict does not depend on the order positions are verified in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from paradecode.runtime.sampling import ACCEPT, RESAMPLE, SAMPLE, Draws, Proposal, Sampler, distribution

if TYPE_CHECKING:
    from paradecode.runtime.decoding import HeadOutput


def verify(
    target: HeadOutput, tokens: Sequence[int], start: int, end: int, bonus: bool, sampler: Sampler | None = None
) -> tuple[int, int | None]:
    """The verdict on the proposals that follow positions start..end-1 of `tokens`: (accepted, next token).

    `bonus`: whether to give the token after the last position when nothing was proposed there and every proposal
    was accepted. `sampler`: None verifies greedily; else by rejection sampling, taking each proposal's draft from
    `sampler.drafts`.

        tokens = [.., 7, 9, 4, 8]  (positions 10-13), group 10..13, target.token = [9, 4, 5, 2] (greedy):
        9 and 4 are accepted, 8 is not:  verify(target, tokens, 10, 14, True) == (2, 5)
        target.token = [9, 4, 8, 2]:      verify(target, tokens, 10, 14, True) == (3, 2)   2: the bonus token
    """
    last = min(end, len(tokens) - 1)  # positions start..last-1 have a proposed successor
    if sampler is None:
        chosen = target.token
        for q in range(start, last):
            if chosen[q - start] != tokens[q + 1]:
                return q - start, chosen[q - start]
        return last - start, chosen[last - start] if bonus and last < end else None
    params, draws, drafts = sampler.params, sampler.draws, sampler.drafts
    for q in range(start, last):
        p = distribution(target.logits[q - start], params)
        accepted, token = rejection_sample(p, tokens[q + 1], drafts.pop(q, None), q, draws)
        if not accepted:
            return q - start, token
    if bonus and last < end:
        return last - start, draws.choice(distribution(target.logits[last - start], params), last, SAMPLE)
    return last - start, None


def rejection_sample(
    p: torch.Tensor, token: int, proposal: Proposal | None, position: int, draws: Draws
) -> tuple[bool, int]:
    """One proposal: `token`, drawn from `proposal` (None: a point mass on it), against p [V] at `position`;
    (accepted, the token the position keeps)."""
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
