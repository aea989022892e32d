"""ParaDecode's planner: what each call computes (docs/design.md §3), as a state machine that makes no calls.

Terms
-----
position   a token's index in the sequence, prompt included. Position q's calls compute tokens[q]'s layers; its
           final head gives the token after it, tokens[q + 1].
depth      the layers a position has computed: -1 before its embedding, 0 after it, L once complete.
group      a run of consecutive unverified positions at one depth, computed together, one call per layer. Depth
           strictly decreases along the groups: a position computes layer j only after every earlier one has (§3.3).
frontier   the last group: the newest token, with the lookup proposals that follow it. Only lane 0 computes it, and
           after an exit layer it may emit its newest position's successor early.
pending    a group that is not the frontier: positions waiting for their remaining layers. Side lanes compute them
           (`streams`, `both`), or the frontier's own calls take them in once it reaches their depth (`batched`,
           `both`: the two groups merge).
proposal   a tentative token tokens[q + 1] (q >= verified - 1) from an exit layer, lookup or the draft head, until
           the final layer's verdict on position q. `source_of[q]` says who proposed it (an exit layer, LOOKUP or
           DRAFT).
verified   tokens[:verified] are verified: only those reach the caller.

The cycle
---------
Lane 0 asks `next_step()` for its next call (a `Step`); a side lane asks `claim()`. Each hands what the call
computed to `computed()`. After an exit layer's head the executor asks the exit heads for a proposal
(`runtime.proposers.ExitHeads`) and hands it to `exit_proposed()`; lookup proposals are asked for here, whenever a
frontier starts (`propose()`). A group that has completed the last layer is taken by `take_verifiable()`, judged by
`runtime.verification.verify`, and the verdict is applied by `settle()`; a rejection is followed by `rollback()`.

Worked example (L = 4, an exit head after layer 2, greedy, K = 4, `batched`; tests/runtime/test_planner.py runs
it), prompt [1, 2], first token 7 (groups written start-end@depth):

    start_frontier(2, 7)        groups 2-2@-1                 the frontier at position 2
    next_step()                 Step(2-2, last=2, exit)       embed + layers 1-2 of position 2, then exit head 2
    exit_proposed(.., 2, 9)     tokens [1, 2, 7, 9]           9 is tentative; groups 2-2@2, 3-3@-1
    next_step()                 Step(3-3, last=2, exit)       position 3 up to layer 2 (K allows another exit)
    exit_proposed(.., 2, None)                                not confident: no proposal
    next_step()                 Step(2-3, last=4)             the groups at depth 2 merge: layers 3-4, final head
    settle(group, 1, 4, out)    out: 9 and 4                  9 accepted, 4 follows it; a new frontier at 4

Nothing here calls a backend, torch or a lock: hidden states are opaque (groups carry them; `join`, the executor's,
concatenates two groups' when they merge), the final head's output is read only for its per-position `margin`, and
the verdicts come from outside. The decisions consult adaptive speculation's estimates (runtime/speculation.py),
which are plain statistics.

Threading model
---------------
The planner has no lock of its own: its executor serialises the calls (runtime/decoding.py; with side lanes
runtime/overlaps.py). With side lanes, `groups`, `frontier` and every field of a `Group` in `groups` are read and
changed only under the executor's lock; everything else (`tokens`, `verified`, `source_of`, `proposal_depth`, `stats`,
the lookup proposer) belongs to lane 0, which alone calls `exit_proposed(..., None)` without that lock. The
speculation estimates and a shared lookup index are the model's, used by every request decoding at once
(runtime/model.py's threading model says how).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime.stats import DRAFT, LOOKUP, GenerationStats, Mismatch

if TYPE_CHECKING:
    from paradecode.runtime.proposers import ExitHeads, LookupProposer
    from paradecode.runtime.speculation import Speculation


@dataclass(eq=False)  # a group is itself: found in `groups` by identity, never compared field by field
class Group:
    start: int  # first position
    end: int  # one past the last position
    depth: int  # layers computed; -1: not embedded yet
    hidden: Any = None  # output of layer `depth` for positions start..end-1 (opaque here)
    busy: bool = False  # claimed by a lane computing a pending group's next layer (side lanes or lane 0)
    final: Any = None  # the final head's output (a `HeadOutput`) once depth == L


class Step(NamedTuple):
    """Lane 0's next call: `group`'s layers from its depth + 1 (its embedding first, at depth -1) up
    to `last`, then the final head if `last` is the last layer. `exit`: then the exit head of layer `last` on the
    group's newest position (`fused`: layer `last` and that head in one graph)."""

    group: Group
    last: int
    exit: bool
    fused: bool


class Planner:
    """One request's ParaDecode state and decisions; see the module's docstring."""

    def __init__(
        self,
        prompt: list[int],
        *,
        num_layers: int,
        exits: ExitHeads,
        max_unverified: int,
        merge: bool,
        last_position: int,
        eos: Collection[int],
        stats: GenerationStats,
        lookup: LookupProposer | None = None,
        draft: Callable[[list[int], int, int], list[int]] | None = None,
        draft_tokens: int = 0,
        speculation: Speculation | None = None,
        join: Callable[[Any, Any], Any] | None = None,
    ):
        # Settings: read-only after __init__.
        self.L = num_layers
        self.exits = exits  # read for its settings (exit layers, fused graphs, heads); asked by the executor
        self.K = max_unverified
        self.merge = merge  # a group that catches up with the one before it merges with it (`batched`, `both`)
        self.last_position = last_position  # the last position whose final output is needed
        self.eos = eos
        self.lookup = lookup
        # draft(tokens, end, count): up to `count` draft-head guesses after tokens[:end] (`DraftProposer`, bound to
        # its executor's calls), asked where lookup has none; at most `draft_tokens` at once
        self.draft, self.draft_tokens = draft, draft_tokens
        self.speculation = speculation  # None: exit and propose whenever allowed
        self.join = join  # (hidden before, hidden after) -> the two groups' hidden state as one
        # next_exit[depth + 1]: the first exit layer above `depth`, or the last layer when none is
        layers = sorted(exits.thresholds)
        self.next_exit = [next((e for e in layers if e > depth), num_layers) for depth in range(-1, num_layers + 1)]
        # Lane 0's.
        self.stats = stats  # the request's: exits, proposals and rollbacks are counted there
        self.tokens = list(prompt)
        self.verified = len(prompt)  # tokens[:verified] are verified
        self.source_of: dict[int, int] = {}  # position q -> who proposed tokens[q + 1]: an exit layer, or LOOKUP
        self.proposal_depth: dict[int, int] = {}  # position q -> tokens[q + 1]'s place in its proposal (1..)
        # Shared with side lanes (under the executor's lock).
        self.groups: list[Group] = []
        self.frontier: Group | None = None

    # --- starting -----------------------------------------------------------------------------------------------------
    def begin(self, token: int) -> None:
        """The token after the prompt is verified (the prefill's, or the one a batch hands back)."""
        self.tokens.append(token)
        self.verified = len(self.tokens)

    def start_frontier(self, position: int, token: int) -> None:
        """Start a new frontier at `position` (tokens[position] is `token`) unless no more output is needed or
        it follows an EOS; with lookup, the tokens it proposes join the frontier."""
        if position > self.last_position or token in self.eos:
            return
        proposals, source = self.propose(position)
        self.tokens.extend(proposals)
        for depth, q in enumerate(range(position, position + len(proposals)), start=1):
            self.source_of[q] = source
            self.proposal_depth[q] = depth
        if source == LOOKUP:
            self.stats.lookup_proposed += len(proposals)
        else:
            self.stats.draft_proposed += len(proposals)
        self.frontier = Group(position, position + 1 + len(proposals), -1)
        self.groups.append(self.frontier)

    def propose(self, position: int) -> tuple[list[int], int]:
        """Proposals to follow tokens[position], with their source (`proposals_after`), within the unverified limit
        and the needed positions; lookup's trimmed, and the draft head's chain sized, to what adaptive speculation
        says pays."""
        room = min(self.K - (len(self.tokens) - self.verified), self.last_position - position)
        keep = chain = None
        if self.speculation is not None:
            speculation, stats = self.speculation, self.stats

            def keep(count: int) -> int:
                kept = speculation.lookup_tokens(count)
                if kept == 0:
                    stats.lookups_skipped += 1
                return kept

            chain = speculation.draft_tokens if self.draft is not None else None
        return proposals_after(
            self.tokens,
            position + 1,
            room,
            self.verified,
            self.eos,
            self.lookup,
            self.draft,
            self.draft_tokens,
            keep,
            chain,
        )

    # --- what to compute ----------------------------------------------------------------------------------------------
    def next_step(self) -> Step | None:
        """Lane 0's next call: the frontier as far as it can go, else (the frontier waits for the
        group before it, or there is none) the latest pending group that can advance, claimed. None: nothing can
        advance until a side lane publishes.

        A group's layers up to its predecessor's depth (for the frontier, up to its next exit layer) depend on
        nothing another lane can change: the predecessor only gets deeper, side lanes never touch the frontier, and
        a claimed group is busy to them. So they are one step.
        """
        if self.frontier is None and not self.groups:  # the last verified token should have stopped decoding
            raise SchedulerStallError(
                f"the ParaDecode scheduler ran out of work at position {self.verified - 1} without a stop decision. "
                "This is a bug: please report it with the settings used."
            )
        group = self.frontier
        if group is not None and group.depth >= 0 and not self.ready_after_merging(group):
            group = None  # the group before has reached the frontier's depth and is not ours to merge
        if group is None:
            group = self.claim(latest=True)  # help complete pending groups rather than idle
            if group is None:
                return None
        index = self.groups.index(group)
        last = self.groups[index - 1].depth if index else self.L
        if group is not self.frontier:
            return Step(group, last, False, False)
        last = min(last, self.next_exit[group.depth + 1])
        # whether the newest token may exit after layer `last` (its exit head is then called)
        exit_now = last in self.exits.thresholds and self.may_exit(group.end) and self.exit_pays(last)
        return Step(group, last, exit_now, exit_now and last in self.exits.fused)

    def ready_after_merging(self, group: Group) -> bool:
        """Merge `group` with the group before it while they are at one depth (where merging is allowed and that
        group is not busy); then whether `group` can compute its next layer now."""
        while True:
            index = self.groups.index(group)
            if index == 0:
                return True
            before = self.groups[index - 1]
            if before.depth > group.depth:
                return True
            if not self.merge or before.busy or before.depth != group.depth:
                return False
            group.start, group.hidden = before.start, self.join(before.hidden, group.hidden)
            self.groups.pop(index - 1)

    def claim(self, latest: bool) -> Group | None:
        """Take a pending group that can advance now, marking it busy; the latest such group, or the earliest."""
        pending = [g for g in self.groups if g is not self.frontier and not g.busy and g.final is None and g.depth >= 0]
        if latest:
            pending.reverse()
        for group in pending:
            if group in self.groups and self.ready_after_merging(group):
                group.busy = True
                return group
        return None

    def has_pending(self) -> bool:
        """Whether there are pending groups (side lanes have work, or will once they can advance)."""
        return len(self.groups) > (self.frontier is not None)

    def may_exit(self, end: int) -> bool:
        """Whether the frontier's newest token (at end - 1) may be emitted early now: fewer than K tokens are
        unverified, and a successor is needed (past the last needed position, or after a proposed EOS, the group
        must finish anyway)."""
        return (
            end <= self.last_position
            and len(self.tokens) - self.verified < self.K
            and self.tokens[end - 1] not in self.eos
        )

    def exit_pays(self, layer: int) -> bool:
        """Whether calling exit layer `layer`'s head is expected to pay (always, without adaptive speculation)."""
        if self.speculation is None or self.speculation.try_exit(layer, self.exits.head[layer] == "final"):
            return True
        self.stats.exits_skipped += 1
        return False

    # --- what was computed --------------------------------------------------------------------------------------------
    def computed(self, group: Group, depth: int, hidden: Any, final: Any) -> None:
        """`group` has computed its layers up to `depth` (`final`: the final head's output, at the last layer)."""
        group.hidden, group.depth, group.final, group.busy = hidden, depth, final, False

    def exit_proposed(self, group: Group, layer: int, token: int | None) -> None:
        """The frontier's exit head at `layer` proposes `token` to follow its newest position (None: no exit). The
        token becomes tentative: the frontier becomes a pending group and a new frontier starts with the token."""
        if self.speculation is not None and (token is not None or self.exits.policy is None):
            self.speculation.head_called(layer, exited=token is not None)  # a measuring policy's misses are not
        if token is None:
            return
        stats = self.stats
        self.tokens.append(token)
        self.source_of[group.end - 1] = layer
        stats.exits_per_layer[layer] = stats.exits_per_layer.get(layer, 0) + 1
        self.frontier = None
        self.start_frontier(group.end, token)

    # --- verdicts -----------------------------------------------------------------------------------------------------
    def take_verifiable(self) -> Group | None:
        """The first group, removed from the groups, once the final layer has run on it: its verdict is due."""
        if self.groups and self.groups[0].final is not None:
            return self.groups.pop(0)
        return None

    def wants_successor(self, group: Group) -> bool:
        """Whether a token should follow `group`'s last position where nothing was proposed after it: not after an
        end-of-sequence token (a proposal that ends with one)."""
        return self.tokens[group.end - 1] not in self.eos

    def settle(self, group: Group, accepted: int, token: int | None, out: list[tuple[int, float]]) -> int:
        """Apply the final layer's verdict on `group` (`runtime.verification.verify`): its first `accepted`
        proposals are verified, and `token` follows them. Each token verified is appended to `out` with its final
        margin. Returns the position whose proposed successor was rejected (its `rollback` is due), else -1."""
        stats, speculation, margins = self.stats, self.speculation, group.final.margin
        start = group.start
        for i in range(accepted):
            position = start + i
            source = self.source_of.pop(position)
            depth = self.proposal_depth.pop(position, None)
            if speculation is not None:
                speculation.verified(source, True, depth)
            stats.accept(source)
            self.verified = position + 2
            out.append((self.tokens[position + 1], margins[i]))
        position = start + accepted
        if position == group.end:  # every position's successor was proposed, and all were accepted
            return -1
        if position + 1 < len(self.tokens):  # its proposed successor was rejected: `token` replaces it
            source = self.source_of.pop(position)
            depth = self.proposal_depth.pop(position, None)
            if speculation is not None:
                speculation.verified(source, False, depth)
            stats.mismatches.append(Mismatch(position + 1, source, self.tokens[position + 1], token, margins[accepted]))
            return position
        if group is self.frontier:
            self.frontier = None
        if token is None:  # a proposal that ended with an EOS, now verified: nothing follows it
            return -1
        self.tokens.append(token)  # the newest position: its final output is the next token
        self.verified = position + 2
        out.append((token, margins[accepted]))
        self.start_frontier(position + 1, token)
        return -1

    def rollback(self, position: int, token: int) -> None:
        """tokens[position + 1] was wrong: discard every later position's work and continue from `token`. The
        executor makes sure no discarded call's result lands, and rolls the cache back."""
        self.stats.rollbacks += 1
        self.groups, self.frontier = [], None
        del self.tokens[position + 1 :]
        self.tokens.append(token)
        self.verified = position + 2
        if self.speculation is not None:  # discarded lookup proposals were paid for: they count as rejected
            for q, source in self.source_of.items():
                if q > position and source == LOOKUP:
                    self.speculation.verified(LOOKUP, accepted=False)
        self.source_of = {q: e for q, e in self.source_of.items() if q < position}
        self.proposal_depth = {q: d for q, d in self.proposal_depth.items() if q < position}
        self.start_frontier(position + 1, token)


def proposals_after(
    tokens: list[int],
    end: int,
    room: int,
    verified: int,
    eos: Collection[int],
    lookup: LookupProposer | None,
    draft: Callable[[list[int], int, int], list[int]] | None,
    draft_tokens: int,
    keep: Callable[[int], int] | None = None,
    chain: Callable[[int], int] | None = None,
) -> tuple[list[int], int]:
    """The one rule of what is proposed to follow tokens[:end] (of which `verified` are verified), alone or in a
    batch's row: lookup's continuation (at most its `max_tokens`; `keep(count)` may keep fewer), else, where it has
    none, the draft head's guesses (`draft(tokens, end, count)`, at most `draft_tokens`; `chain(count)` may ask for
    fewer, none to leave the draft head uncalled); at most `room` in all and up to the first end-of-sequence token.
    With the source (LOOKUP or DRAFT) its verdict is counted under."""
    proposals, source = [], LOOKUP
    if room <= 0:
        return proposals, source
    if lookup is not None:
        proposals = lookup.propose(tokens, end, min(room, lookup.max_tokens), verified)
        if proposals and keep is not None:
            proposals = proposals[: keep(len(proposals))]
    if not proposals and draft is not None:
        count = min(room, draft_tokens)
        if chain is not None and count > 0:
            count = chain(count)
        proposals, source = (draft(tokens, end, count) if count > 0 else []), DRAFT
    for i, token in enumerate(proposals):
        if token in eos:
            return proposals[: i + 1], source
    return proposals, source
