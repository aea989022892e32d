"""A batch step: every sequence of an engine, with its lookup proposals, in one call per segment (runtime/engine.py).

Glossary
--------
row          a sequence of the batch, in row r of the engine's cache; `position` its newest verified token's.
proposals    for a `paradecode` sequence, the lookup proposals that follow its newest token (its own prompt and
             output, then earlier requests' where it asks: runtime/lookup.py), else its draft head's guesses (in
             calls of its row alone; where the request adapts, as many as `Speculation.draft_tokens` says pay),
             at most its K, the tokens it still needs, and the batch's share (`Speculation.batch_proposals`, by
             each row's source's acceptance); none for plain decoding.
T            the call's positions per row: 1 + the most proposals a row takes. A row with fewer is padded with copies
             of its last token at the positions after it: their keys and values land in slots past what the row
             verifies, which its next calls write again before any query of it reads them. Every row's positions
             stay within the cache's slots (the row nearest its end bounds T).

The calls: the rows' tokens [B, T] embedded at their positions, every layer (segments), the final head on every
position ([B, T] flattened row by row). Each row's proposals are then judged by `verify` (greedy, or against the
request's seeded draws): the accepted ones and the token after them are the row's new verified tokens. What a row
gets does not depend on the other rows, nor on how many proposals it was given: a position's bits are the same in
any call (runtime/row_exactness.py checks it on the machine) and verification keeps plain decoding's tokens.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from paradecode.runtime.decoding import MAIN, DecodeContext, HeadOutput, RowsContext
from paradecode.runtime.planner import proposals_after
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import LOOKUP
from paradecode.runtime.verification import verify

if TYPE_CHECKING:
    from paradecode.runtime.engine import Sequence


class BatchStep:
    """The batch steps of an engine's first B rows (`ctx`'s cache is a view of them)."""

    def __init__(self, ctx: RowsContext):
        self.ctx = ctx
        self._row_contexts: dict[int, DecodeContext] = {}  # row -> the calls of that row alone (a draft head's)

    def run(self, sequences: list[Sequence], estimates: Speculation) -> list[list[tuple[int, float]]]:
        """One step of `sequences` (sequence r in row r), its speculation decided and learned by `estimates`: per
        row, its new verified tokens with their final margins, in order (its accepted proposals, then the token after
        them)."""
        ctx = self.ctx
        proposals, sources = zip(*[self.proposals(s, r, estimates) for r, s in enumerate(sequences)])
        share = estimates.batch_proposals([len(p) for p in proposals], list(sources))
        # every row's positions, padding included, within the cache: the row nearest its end bounds the step
        room = min(ctx.cache.shape[2] - s.position for s in sequences) - 1
        proposals = [p[: min(share, room)] for p in proposals]
        tokens = 1 + max(len(p) for p in proposals)
        rows = []
        for sequence, proposed in zip(sequences, proposals):
            row = [sequence.completion.tokens[-1], *proposed]
            rows.append(row + [row[-1]] * (tokens - len(row)))
        ctx.begin([s.position for s in sequences])
        hidden = ctx.layers(MAIN, 1, ctx.num_layers, ctx.embed_rows(rows), 0)
        sampled = any(s.sampler is not None for s in sequences)
        out = ctx.head(MAIN, "final", hidden, 0, logits=sampled)
        verdicts = []
        for r, (sequence, proposed) in enumerate(zip(sequences, proposals)):
            verdicts.append(verdict(sequence, proposed, sources[r], row_of(out, r, tokens), estimates))
            if sequence.draft is not None:  # the positions whose successors are now verified
                sequence.draft.verified(sequence.position, hidden[r : r + 1, : len(verdicts[-1])])
        return verdicts

    def proposals(self, sequence: Sequence, row: int, estimates: Speculation) -> tuple[list[int], int]:
        """The proposals to follow `sequence`'s newest token (in row `row`), with their source, by the rule the lone
        path follows (runtime/planner.py `proposals_after`): at most its K, and no further than its last needed
        position; where the request adapts, the draft head's chain sized by `estimates` as a lone sequence's is
        (its calls are this row's alone: what the batch's sizing cuts later was drafted all the same)."""
        request, history, draft = sequence.request, sequence.history, sequence.draft
        stops = request.stops
        room = min(request.max_unverified, stops.last_position - sequence.position)
        guesses, most, chain = None, 0, None
        if draft is not None:  # its guesses drafted in calls of this row alone
            guesses, most = partial(draft.propose, self.row_context(row)), draft.max_tokens
            chain = estimates.draft_tokens if request.adaptive else None
        return proposals_after(
            history, len(history), room, len(history), stops.eos, sequence.lookup, guesses, most, chain=chain
        )

    def row_context(self, row: int) -> DecodeContext:
        """The calls of row `row` alone, over its view of the batch's cache."""
        ctx = self._row_contexts.get(row)
        if ctx is None:
            whole = self.ctx
            ctx = DecodeContext(whole.backend, whole.cache.rows(row, row + 1), whole.timeline, observe=whole.observe)
            self._row_contexts[row] = ctx
        return ctx


def verdict(
    sequence: Sequence, proposed: list[int], source: int, target: HeadOutput, estimates: Speculation
) -> list[tuple[int, float]]:
    """`sequence`'s new verified tokens from the final head's output on its row (`target`, its T positions), its
    proposals having come from `source` (LOOKUP or DRAFT)."""
    start = sequence.position
    tokens = [*sequence.history, *proposed]
    accepted, token = verify(target, tokens, start, start + 1 + len(proposed), True, sequence.sampler)
    stats = sequence.stats
    if source == LOOKUP:
        stats.lookup_proposed += len(proposed)
        stats.lookup_accepted += accepted
    else:
        stats.draft_proposed += len(proposed)
        stats.draft_accepted += accepted
    for depth in range(1, len(proposed) + 1):  # judged in order: the first rejected ends the judging
        judged = depth <= accepted + 1
        estimates.verified(source, depth <= accepted, depth if judged else None)
    if accepted < len(proposed):
        stats.rollbacks += 1
    kept = [*proposed[:accepted], token]
    return [(t, target.margin[i]) for i, t in enumerate(kept)]


def row_of(out: HeadOutput, row: int, tokens: int) -> HeadOutput:
    """Row `row`'s positions of a head's output over rows of `tokens` positions each, flattened row by row."""
    span = slice(row * tokens, (row + 1) * tokens)
    logits = None if out.logits is None else out.logits[span]
    return HeadOutput(out.token[span], out.prob[span], out.margin[span], logits)
