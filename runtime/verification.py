"""Verification: the final layer's verdict on proposed tokens, greedy or sampled (docs/design.md §3.4).

One function, `verify`, for both, in the shape of vLLM's rejection sampler: given the proposed tokens and the
target's outputs at their positions, it returns how many proposals are accepted and the token that follows them.

Glossary
--------
group        positions start .. end - 1, consecutive, on which the final head has just run (T = end - start).
target       the final head's output there (`HeadOutput`): `token` [T], its top-1 per position, and, when sampling,
             `logits` [T, V]. Index i is position start + i.
proposed     tokens[q + 1] for a group position q, where it exists: the token proposed to follow q (an exit token or
             a lookup proposal), not verified yet. Only the group's last position may have none: the newest token.
chosen       the token plain decoding puts after q: greedy, the target's top-1; sampling, the draw from
             distribution(target.logits[q]) with the uniform keyed by (seed, q, SAMPLE) (runtime/sampling.py).
accepted     the number of proposals accepted, in order, before the first rejection: a proposal is accepted where it
             is the chosen token.
next token   what follows the accepted proposals: the chosen token at the first rejected position, or, when every
             proposal was accepted and the group's last position had none (`bonus`), the chosen token there.
             Otherwise None.

So the verified sequence is plain decoding's whatever was proposed, greedy or sampled: a sampled position keeps the
token plain sampling draws there with the same seed, and a proposal only decides whether that token was known
early. For a lookup proposal (a point mass on a token d) the chance of acceptance is p(d), as with speculative
rejection sampling (Leviathan et al. 2023); an exit head draws its proposal with the same uniform from its own
distribution (`Sampler.draw_exit`), so it is accepted where both draws land on one token. Since the verdicts do not
depend on the proposals, a sequence decoded alone, with ParaDecode or in a batch gives the same tokens for a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paradecode.runtime.sampling import SAMPLE, Sampler, distribution

if TYPE_CHECKING:
    from paradecode.runtime.decoding import HeadOutput


def verify(
    target: HeadOutput, tokens: Sequence[int], start: int, end: int, bonus: bool, sampler: Sampler | None = None
) -> tuple[int, int | None]:
    """The verdict on the proposals that follow positions start..end-1 of `tokens`: (accepted, next token).

    `bonus`: whether to give the token after the last position when nothing was proposed there and every proposal
    was accepted. `sampler`: None verifies greedily; else against the sampled draws (the request's parameters and
    seed).

        tokens = [.., 7, 9, 4, 8]  (positions 10-13), group 10..13, target.token = [9, 4, 5, 2] (greedy):
        9 and 4 are accepted, 8 is not:  verify(target, tokens, 10, 14, True) == (2, 5)
        target.token = [9, 4, 8, 2]:      verify(target, tokens, 10, 14, True) == (3, 2)   2: the bonus token
    """
    last = min(end, len(tokens) - 1)  # positions start..last-1 have a proposed successor
    for q in range(start, last):
        token = chosen(target, q - start, q, sampler)
        if token != tokens[q + 1]:
            return q - start, token
    if bonus and last < end:
        return last - start, chosen(target, last - start, last, sampler)
    return last - start, None


def chosen(target: HeadOutput, index: int, position: int, sampler: Sampler | None) -> int:
    """The token plain decoding puts after `position` (the target's `index`-th): its top-1 when greedy, else the
    draw from its distribution keyed by the position."""
    if sampler is None:
        return target.token[index]
    return sampler.draws.choice(distribution(target.logits[index], sampler.params), position, SAMPLE)
