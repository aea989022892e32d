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

- `DraftProposer.propose(ctx, tokens, end, count) -> list[int]`: up to `count` tokens guessed one after another by
  the export's draft head (its graph `draft`, graphs/tensors.py) from the last layer's outputs at verified positions,
  which it is handed as they are verified (`verified`). The planner asks it where lookup has nothing; an engine's
  batch step likewise, per row.

The signatures differ in what they read, tokens, a call's output or the last layer's outputs; the planner takes the
answers alike, as tokens with their source (an exit layer, LOOKUP or DRAFT) that stay tentative until verified.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch

from paradecode.runtime.lookup import LookupConfig, Proposer, SharedSuffixIndex, SuffixIndex

MAIN_LANE = "main"  # the lane a draft's calls run on: the decoding thread's (runtime/decoding.py MAIN)
FEED_WINDOW = 64  # the most positions one feed of the draft head writes rows for (DraftProposer)

if TYPE_CHECKING:
    from paradecode.runtime.decoding import DecodeContext, HeadOutput
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


class DraftProposer:
    """A request's draft head (graphs/modules.py `DraftGraph`): its guesses at the tokens after the newest verified one.

    The draft's row for position p reads the last layer's output at p - 1 and the embedding of tokens[p], and guesses
    tokens[p + 1]. Its cache (the KV cache's layer L + 1) holds, at the positions before `fed`, rows computed from
    verified positions only; the executor hands over the last layer's outputs of verified positions as the final
    head's verdicts come in (`verified`), and `propose` first feeds the ones not fed yet in one call (writing their
    rows), then drafts a chain, each guess's output and embedding giving the next guess. The chain's rows land past
    the newest verified position, where the next feed writes again before any later query reads them (a query reads
    only the slots at or before its position), so nothing is rolled back here.

    Worked example (prompt of 4 tokens, first token 9 verified by the prefill):

        verified(0, h[0..3])            outputs of positions 0..3: each one's successor is verified
        propose(ctx, tokens, 5, 3)      one call over positions 1..4 (h[0..3] beside tokens[1..4]), its guess at
                                        position 4 is tokens[5]'s; then two calls of one position: 3 tokens
        verified(4, h[4..5])            the verdict on positions 4..5 (one guess accepted, the token after it)
        propose(ctx, tokens, 7, 3)      one call over positions 5..6, then a chain from position 6

    Where the outputs handed over skip positions (a sequence that decoded in a batch's rows without a draft), the
    feed starts again from the newest ones: the rows before them are stale, which makes guesses worse, never
    outputs other (the final layer verifies every guess).

    A feed writes the rows of the newest FEED_WINDOW positions at most: a long prompt's first proposal would
    otherwise run the draft layer over every prompt position inside decoding time (a 400-token passage: a few times
    a token's cost, for answers of a few tokens). The older rows are zeroed (`KVCache.zero`), as the draft's slot 0
    is: guesses read less of the prompt, and the same whatever the cache held before.

    A head that reads three layers' outputs (`reduces`: EAGLE-3's fusion) feeds what its map makes of the outputs
    handed over and of the feature layers' at the same positions (the cache keeps those: `DecodeContext.features`);
    its chain reads its own outputs, as the single-layer head's does."""

    def __init__(self, max_tokens: int, layer: int, *, reduces: bool = False):
        self.max_tokens = max_tokens
        self.layer = layer  # the KV cache's layer that holds the draft's rows: L + 1
        self.reduces = reduces  # whether its feed goes through its map of three layers' outputs first
        self.fed = 1  # the draft's rows of positions 1..fed-1 are in its cache (position 0 has nothing before it)
        self.feed_window = FEED_WINDOW
        self.pending: torch.Tensor | None = None  # [1, n, D]: outputs of positions fed-1.. not fed yet

    def verified(self, start: int, hidden: torch.Tensor) -> None:
        """The last layer's outputs [1, n, D] at positions start..start+n-1, whose successors are verified."""
        first, held = self.fed - 1, 0 if self.pending is None else self.pending.shape[1]
        if start > first + held:  # a gap: start again from these
            self.fed, self.pending = start + 1, hidden
            return
        skip = max(0, first - start)  # outputs of positions whose rows are in the cache already
        if skip >= hidden.shape[1]:
            return
        keep = start + skip - first  # the pending outputs before these
        self.pending = hidden[:, skip:] if keep == 0 else torch.cat([self.pending[:, :keep], hidden[:, skip:]], 1)

    def propose(self, ctx: DecodeContext, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` guesses at the tokens after tokens[:end] (tokens[end - 1] verified), or none where the
        outputs up to position end - 2 have not all been handed over."""
        p = end - 1
        if count < 1 or self.pending is None or self.fed - 1 + self.pending.shape[1] != p:
            return []
        start = max(self.fed, p + 1 - self.feed_window)
        if start > self.fed:  # rows left unfed: zeros, as a fresh cache's
            ctx.cache.zero(self.layer, self.fed, start)
        pending = self.pending[:, start - self.fed :]
        embedded = ctx.embed(MAIN_LANE, list(tokens[start : p + 1]), start)
        fed = ctx.draft_reduce(MAIN_LANE, pending, start) if self.reduces else pending
        hidden, out = ctx.draft(MAIN_LANE, self.layer, fed, embedded, start)
        self.fed, self.pending = p + 1, None
        guesses = [out.token[-1]]
        hidden = hidden[:, -1:]
        for position in range(p + 1, p + count):
            embedded = ctx.embed(MAIN_LANE, guesses[-1:], position)
            hidden, out = ctx.draft(MAIN_LANE, self.layer, hidden, embedded, position)
            guesses.append(out.token[0])
        return guesses
