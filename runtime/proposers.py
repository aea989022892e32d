"""Where ParaDecode's tentative tokens come from: the exit heads and lookup (docs/design.md §2-3).

A proposer says which tokens should follow position q = end - 1, before the final layer has run on q; the final
layer then verifies each one (runtime/verification.py), so a proposer decides only how fast decoding goes, never
what it writes. Each answers from its inputs alone (lookup's indexes only save a scan; the shared one holds earlier
requests' outputs), with the tokens it proposes:

- `LookupProposer.propose(tokens, end, count, verified) -> list[int]`: up to `count` tokens, read from the tokens
  so far, of which the first `verified` are verified (runtime/lookup.py). The planner asks it whenever a frontier
  starts; an engine's batch step, before each step.
- `ExitHeads.propose(position, layer, out) -> int | None`: one token, or none, read from an exit head's output at
  `position` after exit layer `layer`. The executor asks it after it has called that head, and hands the answer to
  the planner (`Planner.exit_proposed`).

The two signatures differ in what they read, tokens or a call's output; the planner takes both answers alike, as
tokens with their source (an exit layer, or LOOKUP) that stay tentative until verified.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from paradecode.runtime.lookup import LookupConfig, Proposer, SharedSuffixIndex, SuffixIndex

if TYPE_CHECKING:
    from paradecode.runtime.decoding import HeadOutput
    from paradecode.runtime.sampling import Sampler


class LookupProposer:
    """A request's lookup: its own prompt and verified output (`SuffixIndex`), then, where they have no match, the
    outputs of earlier requests (a model's `SharedSuffixIndex`); the first non-empty answer is the proposal.

    The answer is a function of the tokens alone (and the shared index's outputs): the request's index only saves a
    scan, and takes in the verified tokens it has not seen at each ask (verified tokens never change; an index only
    grows). Worked example (min_ngram 2, max_ngram 16, length_factor 1.0):

        tokens = [5, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]
        propose(tokens, 12, 5, verified=12) -> [9, 4, 6]      the request's own match, [5, 6, 7] (3 tokens: 3 long)
        tokens = [2, 3]: no match in the request; an earlier output [.., 2, 3, 8, 1]
        propose(tokens, 2, 5, verified=2) -> [8, 1]
    """

    def __init__(self, config: LookupConfig, shared: SharedSuffixIndex | None = None):
        self.config = config
        self.index = SuffixIndex(config)
        self.max_tokens = config.max_tokens
        self.proposers: list[Proposer] = [self.index] if shared is None else [self.index, shared]

    def propose(self, tokens: Sequence[int], end: int, count: int, verified: int) -> list[int]:
        """Up to `count` tokens to follow tokens[:end], of which tokens[:verified] are verified: the first proposer's
        that has any."""
        self.index.extend(tokens, verified)
        proposals: list[int] = []
        for proposer in self.proposers:
            proposals = proposer.propose(tokens, end, count)
            if proposals:
                break
        return proposals

    def rewind(self, verified: int) -> None:
        """Forget the tokens past the first `verified`: an executor that is closed may have verified tokens its
        sequence never received (they are decoded again, in a batch). The index is rebuilt at the next ask."""
        if self.index.indexed > verified:
            self.index = SuffixIndex(self.config)
            self.proposers[0] = self.index


class ExitHeads:
    """The exit heads as a proposer (docs/design.md §3.2): after exit layer e, the head's top-1 token at the
    frontier's newest position is proposed when its probability reaches e's threshold.

    Worked example (greedy, thresholds {2: 0.8}; `out` is exit head 2's output at position 9):

        out.token == [17], out.prob == [0.91]  ->  propose(9, 2, out) == 17
        out.token == [17], out.prob == [0.42]  ->  propose(9, 2, out) is None

    Sampling: the proposed token is drawn from the head's own distribution q (the request's temperature, top-k and
    top-p) with the uniform the final layer's draw at the position uses (`Sampler.draw_exit`). Whether a token exits
    depends only on the head's confidence, never on the draw. A `policy(position, layer, out)` (for
    measurements only: tools/characterise.py) replaces the threshold test: it returns the token, or None.

    Settings the planner reads: `thresholds` (the exit layers that may exit: a threshold above 1 means never, so
    that layer's head is not even run), `head` (each one's graph: its trained head, else the final head's), and
    `fused` (those whose layer and head the export also fused into one graph; sampling needs the head's logits,
    which a fused graph does not give, so it runs the two calls).
    """

    def __init__(
        self,
        thresholds: dict[int, float],
        names: Collection[str],
        sampler: Sampler | None = None,
        policy: Callable[[int, int, HeadOutput], int | None] | None = None,
    ):
        self.thresholds = {e: g for e, g in thresholds.items() if g <= 1.0}
        self.head = {e: f"exit_{e}" if f"exit_{e}" in names else "final" for e in self.thresholds}
        self.fused = {e for e in self.thresholds if f"layer_exit_{e}" in names} if sampler is None else set()
        self.sampler = sampler  # None: greedy
        self.policy = policy

    def propose(self, position: int, layer: int, out: HeadOutput) -> int | None:
        """The token exit layer `layer`'s head proposes to follow `position`, from its output there; or None."""
        if self.policy is not None:
            return self.policy(position, layer, out)
        if out.prob[0] < self.thresholds[layer]:  # the head's confidence: never depends on a draw
            return None
        if self.sampler is None:
            return out.token[0]
        return self.sampler.draw_exit(position, out.logits[0], reduced=self.head[layer] != "final")
