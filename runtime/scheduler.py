"""The ParaDecode scheduler (docs/design.md §3), over lanes.

State. The unverified positions form *groups*: contiguous runs of positions at the same depth
(layers computed), holding their hidden state. Depth strictly decreases along positions, so a
group may compute its next layer once the group before it is deeper (§3.3); when a group catches
up with the one before it, the two are merged into one batched call (`batched`, `both`) or the
later one waits (`streams`). The last group is the *frontier*: the newest token, run by lane 0.

Flow. After each exit layer the frontier's exit head may emit its newest token early (top-1
probability >= the layer's threshold, fewer than K unverified tokens): the frontier becomes a
pending group and the next token starts at once. With lookup on, a new frontier also takes the
tokens that followed the earlier occurrences of its newest tokens (`runtime.lookup`) as proposals
pending at depth 0: they go up the layers in the frontier's own batched calls and the final layer
verifies them like early tokens. Pending groups are completed by side lanes right
away (`streams`, `both`), or batched into the frontier's calls when it reaches their depth
(`batched`, `both`). A group that completes the last layer gets the final head; lane 0 verifies
its positions in order and on the first mismatch rolls back: the correct token replaces the early
one and everything computed for later positions is discarded (in-flight calls finish first, so no
stale cache write can land after the new one).

Threading model
---------------
One `ParaDecoder` serves one generate call; all its state is created in `__init__`.

- Lane 0 is the calling thread. It runs `run()`, makes every decision (exits, verification,
  rollback) and is the only lane that computes the frontier. Side lanes (worker threads, one per
  extra lane, in `streams` and `both`) only compute the next layer of pending groups.
- Set in `__init__` and read-only after: the settings (`ctx`, `stops`, `L`, `thresholds`, `exit_head`, `fused`,
  `K`, `merge`, `side_lanes`, `exit_policy`, `last_position`, `sync`, the list `proposers`) and the lock
  and conditions (a model's `SharedSuffixIndex`, one of the proposers, locks itself).
- Owned by lane 0 (only lane 0 reads or writes them): `stats` (the request's counters), `tokens`, `verified`,
  `source_of`, `lookup_depth`, `proposals`, `lookup`, `draws`, `waited`, `speculation`.
- Guarded by `lock` (any lane reads or writes them only while holding it): `groups`, `frontier`,
  `epoch`, `in_flight`, `stopping`, `error`, every field of a `Group` in `groups`, and the KV
  cache's lengths (`cache.written`, `cache.rollback`).
- Claiming: a lane takes a group by marking it `busy` under the lock (lane 0 owns the frontier
  without marking it). It then computes that group's next layers *without* the lock, from the
  hidden state and depth it read under the lock, and publishes the result under the lock. No other
  lane touches a busy group, and merging (`ready`) never takes a busy group.
- A rollback (lane 0, under the lock) bumps `epoch` and waits until `in_flight` is zero, so a side
  lane's late result is dropped (its epoch is stale) and no stale cache write lands after a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime.completion import Stops
from paradecode.runtime.decoding import MAIN, DecodeContext, HeadOutput, choose, prefill
from paradecode.runtime.lanes import Future, Lane
from paradecode.runtime.lookup import LookupConfig, Proposer, SharedSuffixIndex, SuffixIndex
from paradecode.runtime.sampling import PROPOSE, Draws, Proposal, SamplingParams, distribution, verify
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import LOOKUP, GenerationStats, Mismatch

logger = logging.getLogger(__name__)

WAIT_SECONDS = 5.0  # one condition wait
STALL_SECONDS = 120.0  # no progress for this long is a bug: raise instead of hanging


@dataclass
class Group:
    start: int  # first position
    end: int  # one past the last position
    depth: int  # layers computed; -1: not embedded yet
    hidden: torch.Tensor | None = None  # output of layer `depth` for positions start..end-1
    busy: bool = False  # claimed by a lane computing a pending group's next layer (side lanes or lane 0)
    final: HeadOutput | None = None  # the final head's outputs, once depth == L


class ParaDecoder:
    def __init__(
        self,
        ctx: DecodeContext,
        prompt: list[int],
        stops: Stops,
        stats: GenerationStats,
        *,
        thresholds: dict[int, float],
        max_unverified: int,
        overlap: str,
        side_lanes: list[Lane],
        exit_policy=None,
        lookup: LookupConfig | None = None,
        shared: SharedSuffixIndex | None = None,
        sampling: SamplingParams | None = None,
        speculation: Speculation | None = None,
    ):
        # Settings: read-only after __init__.
        self.ctx = ctx
        self.stops = stops
        self.prompt = list(prompt)
        self.L = ctx.num_layers
        self.thresholds = {e: g for e, g in thresholds.items() if g <= 1.0}  # "never" layers are not even run
        names = ctx.backend.subgraph_names
        # Each exit layer's head: its trained head, else the model's own final norm and unembedding (`final`).
        self.exit_head = {e: f"exit_{e}" if f"exit_{e}" in names else "final" for e in self.thresholds}
        # Exit layers whose layer and head the export also fused into one graph (one call, not two). Sampling
        # needs the head's logits, which a fused graph does not give: it runs the two calls.
        self.fused = {e for e in self.thresholds if f"layer_exit_{e}" in names} if sampling is None else set()
        self.sampling = sampling  # None: greedy
        self.draws = Draws(sampling.seed) if sampling is not None else None
        self.exit_vocab = ctx.backend.exit_vocab() if sampling is not None else None
        self.K = max_unverified
        self.merge = overlap in ("batched", "both")
        self.side_lanes = side_lanes if overlap in ("streams", "both") else []
        # For measurements only (tools/characterise.py): `exit_policy(position, layer, head_output)` returns
        # the early token, or None for no exit, in place of the threshold test. The head still runs.
        self.exit_policy = exit_policy
        # Adaptive speculation (runtime/speculation.py): exit heads and lookup only while they pay; None: always.
        self.speculation = speculation
        self.last_position = stops.last_position - 1  # the last position whose output is needed
        self.sync = ctx.backend.device.type == "cuda"  # publish GPU results only once their stream is done
        # One lock, two conditions: lane 0 waits on `cond`; side lanes wait on `work`, which is only
        # signalled when pending groups exist, so idle side lanes cost nothing when nothing exits.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.work = threading.Condition(self.lock)
        # Owned by lane 0.
        self.stats = stats  # the request's: this decoder counts its exits, proposals and rollbacks there
        self.tokens = list(prompt)
        self.verified = len(prompt)  # tokens[:verified] are verified
        self.source_of: dict[int, int] = {}  # position q -> who proposed tokens[q + 1]: an exit layer, or LOOKUP
        self.lookup_depth: dict[int, int] = {}  # position q -> tokens[q + 1]'s place in its lookup proposal (1..)
        self.proposals: dict[int, Proposal] = {}  # sampling: position q -> the q tokens[q + 1] was drawn from
        self.lookup = SuffixIndex(lookup) if lookup is not None else None
        # asked in order, the first non-empty answer taken: the request's own tokens, then earlier requests' outputs
        self.proposers: list[Proposer] = [p for p in (self.lookup, shared) if p is not None] if self.lookup else []
        self.waited = 0.0  # seconds lane 0 has waited without progress
        # Guarded by `lock`.
        self.groups: list[Group] = []
        self.frontier: Group | None = None
        self.epoch = 0  # bumped by every rollback and at the end: results of an older epoch are dropped
        self.in_flight = 0  # side-lane calls running
        self.stopping = False
        self.error: BaseException | None = None  # a side lane's error, raised by lane 0

    # --- the generator lane 0 runs ------------------------------------------------------------
    def run(self, resume: int | None = None) -> Iterator[tuple[int, float, str | None]]:
        """The verified tokens after the prompt, the first from its prefill, each with the stop decision after it
        (`Stops`): it ends after the one that stops. `resume`: the prompt is already in the cache at every layer (a
        batch hands a request back to ParaDecode) and `resume` is the token after it, verified and already
        returned: decoding goes on from there, yielding only the tokens after it."""
        n = len(self.prompt)
        if resume is None:
            token, margin = prefill(self.ctx, self.prompt, self.sampling, self.draws)
        else:
            token = resume
            for layer in range(1, self.L + 1):
                self.ctx.cache.written(layer, n)
        self.tokens.append(token)
        self.verified = n + 1
        if self.lookup is not None:
            self.lookup.extend(self.tokens, self.verified)
        position = n  # the newest verified token's
        if resume is None:
            stop = self.stops.after(token, position)
            yield token, margin, stop
            if stop is not None:
                return
        with self.lock:
            self.start_frontier(n, token)
        workers: list[Future] = [lane.submit(self.side_worker, lane.name) for lane in self.side_lanes]
        failed = False
        try:
            while True:
                for token, margin in self.verify_finished():
                    position += 1
                    stop = self.stops.after(token, position)
                    yield token, margin, stop
                    if stop is not None:
                        return  # nothing after it was started (`start_frontier`, `propose`, `verify_finished`)
                with self.lock:
                    if self.frontier is None and not self.groups:  # the last token stops before this
                        raise SchedulerStallError(
                            f"the ParaDecode scheduler ran out of work at position {position} without a stop "
                            "decision. This is a bug: please report it with the settings used."
                        )
                self.main_step()
        except BaseException:  # closing early (GeneratorExit) included: the stop below must not mask it
            failed = True
            raise
        finally:
            self.stop_side_lanes(workers, raise_errors=not failed)

    def stop_side_lanes(self, workers: list[Future], *, raise_errors: bool) -> None:
        """Tell the side lanes to stop and wait for them. With an error already propagating, a lane that
        does not stop is logged, never raised: the first error is the one the caller sees."""
        with self.lock:
            self.stopping = True
            self.epoch += 1
            self.progress()
        for lane, worker in zip(self.side_lanes, workers):
            try:
                worker.wait(STALL_SECONDS)
            except TimeoutError:
                error = SchedulerStallError(
                    f"side lane {lane.name} did not stop within {STALL_SECONDS:g} s of the end of the generation "
                    "(a bug: please report it with the settings used)"
                )
                if raise_errors:
                    raise error from None
                logger.error("%s", error)

    def wait(self, condition: threading.Condition, what: str) -> None:
        """Wait for progress (lock held); a stall of STALL_SECONDS is an error naming `what`, not a hang."""
        if condition.wait(WAIT_SECONDS):
            self.waited = 0.0
            return
        self.waited += WAIT_SECONDS
        if self.waited >= STALL_SECONDS:
            state = ", ".join(f"{g.start}-{g.end - 1}@{g.depth}{' busy' if g.busy else ''}" for g in self.groups)
            raise SchedulerStallError(
                f"the ParaDecode scheduler made no progress for {STALL_SECONDS:g} s while lane 0 waited for "
                f"{what} (groups: {state or 'none'}; side-lane calls in flight: {self.in_flight}). This is a bug: "
                "please report it with the settings used."
            )

    def publish(self) -> None:
        """On a GPU, wait for this lane's stream so another lane may read what it computed."""
        if self.sync:
            torch.cuda.current_stream().synchronize()

    def start_frontier(self, position: int, token: int) -> None:
        """Start a new frontier at `position` (tokens[position] is `token`) unless no more output is needed or
        it follows an EOS; with lookup, the tokens it proposes join the frontier. Lock held."""
        if position > self.last_position or token in self.stops.eos:
            return
        proposals = self.propose(position)
        self.tokens.extend(proposals)
        for depth, q in enumerate(range(position, position + len(proposals)), start=1):
            self.source_of[q] = LOOKUP
            self.lookup_depth[q] = depth
        self.stats.lookup_proposed += len(proposals)
        self.frontier = Group(position, position + 1 + len(proposals), -1)
        self.groups.append(self.frontier)

    def propose(self, position: int) -> list[int]:
        """Lookup proposals to follow tokens[position]: within the unverified limit, the needed positions,
        and up to the first EOS."""
        if self.lookup is None:
            return []
        room = min(
            self.lookup.config.max_tokens,
            self.K - (len(self.tokens) - self.verified),
            self.last_position - position,
        )
        self.index_verified()  # a rollback proposes before verify_finished indexes what it verified
        proposals = []
        for proposer in self.proposers:
            proposals = proposer.propose(self.tokens, position + 1, room)
            if proposals:
                break
        if proposals and self.speculation is not None:
            keep = self.speculation.lookup_tokens(len(proposals))
            if keep == 0:
                self.stats.lookups_skipped += 1
            proposals = proposals[:keep]
        for i, token in enumerate(proposals):
            if token in self.stops.eos:
                return proposals[: i + 1]
        return proposals

    # --- lane 0: one step of work -----------------------------------------------------------
    def main_step(self) -> None:
        """Advance one group as far as it can go without anyone else: the frontier, else a pending group.

        A group's next layers up to its predecessor's depth (and, for the frontier, up to its next
        active exit layer) depend on nothing another lane can change: the predecessor only gets
        deeper, side lanes never touch the frontier, and a claimed group is busy to them. So those
        layers run in one loop without the lock, and the result is published once.
        """
        with self.lock:
            self.raise_side_error()
            group = self.frontier
            if group is not None and group.depth >= 0 and not self.ready(group):
                group = None  # the group before has reached the frontier's depth and is not ours to merge
            if group is None:
                group = self.claim(order="latest")  # help complete pending groups rather than idle
                if group is None:
                    self.wait(self.cond, "a pending group to be computed by a side lane")
                    return
            index = self.groups.index(group)
            stop = self.groups[index - 1].depth if index else self.L
            hidden, depth, start, end = group.hidden, group.depth, group.start, group.end
        frontier = group is self.frontier
        if frontier:
            stop = min([stop] + [e for e in self.thresholds if e > depth])
        # whether the frontier's newest token may exit after layer `stop` (its exit head is then called)
        exit_now = frontier and stop in self.thresholds and self.may_exit(end) and self.exit_pays(stop)
        first, final, early = depth + 1, None, None
        if depth == -1:
            hidden, depth, first = self.ctx.embed(MAIN, self.tokens[start:end], start), 0, 1
        # the exit layer `stop` in one call with its head, where the export fused them and the frontier may exit
        fused_exit = exit_now and stop in self.fused
        if depth < stop - fused_exit:  # the layers before: segments where they cover them, else one call each
            hidden, depth = self.ctx.layers(MAIN, depth + 1, stop - fused_exit, hidden, start), stop - fused_exit
        if fused_exit and depth < stop:
            hidden, early = self.ctx.layer_exit(MAIN, stop, hidden, start)
            depth = stop
        if depth == self.L:
            final = self.ctx.head(MAIN, "final", hidden, start, logits=self.sampling is not None)
        self.publish()
        with self.lock:
            for layer in range(first, depth + 1):
                self.ctx.cache.written(layer, end)
            group.hidden, group.depth, group.final, group.busy = hidden, depth, final, False
            self.progress()
        if final is None and exit_now and depth == stop:
            self.try_exit(group, depth, early)

    def progress(self) -> None:
        """Wake whoever may now proceed (lock held): lane 0 always, side lanes when there is pending work."""
        self.cond.notify_all()
        if self.side_lanes and (self.stopping or len(self.groups) > (self.frontier is not None)):
            self.work.notify_all()

    def ready(self, group: Group) -> bool:
        """Can `group` compute its next layer now? Merges it with the group before when allowed (lock held)."""
        while True:
            index = self.groups.index(group)
            if index == 0:
                return True
            before = self.groups[index - 1]
            if before.depth > group.depth:
                return True
            if not self.merge or before.busy or before.depth != group.depth:
                return False
            group.start, group.hidden = before.start, torch.cat([before.hidden, group.hidden], dim=1)
            self.groups.pop(index - 1)

    def claim(self, order: str) -> Group | None:
        """Take a pending group that can advance now (lock held); `order` says which to prefer."""
        pending = [g for g in self.groups if g is not self.frontier and not g.busy and g.final is None and g.depth >= 0]
        if order == "latest":
            pending.reverse()
        for group in pending:
            if group in self.groups and self.ready(group):
                group.busy = True
                return group
        return None

    def exit_pays(self, layer: int) -> bool:
        """Whether calling exit layer `layer`'s head is expected to pay (always, without adaptive speculation)."""
        if self.speculation is None or self.speculation.try_exit(layer, self.exit_head[layer] == "final"):
            return True
        self.stats.exits_skipped += 1
        return False

    def may_exit(self, end: int) -> bool:
        """Whether the frontier's newest token (at end - 1) may be emitted early now: fewer than K tokens are
        unverified, and a successor is needed (past the last needed position, or after a proposed EOS, the group
        must finish anyway)."""
        return (
            end <= self.last_position
            and len(self.tokens) - self.verified < self.K
            and self.tokens[end - 1] not in self.stops.eos
        )

    def try_exit(self, group: Group, layer: int, out: HeadOutput | None = None) -> None:
        """After an exit layer: emit the frontier's newest token early if its exit head is confident enough.

        `out` is the exit head's output when the fused layer_exit graph computed it already. The caller has
        checked that the token may exit (`may_exit`) and that trying pays (`exit_pays`).
        """
        if out is None:
            name = self.exit_head[layer]
            out = self.ctx.head(MAIN, name, group.hidden[:, -1:], group.end - 1, logits=self.sampling is not None)
        if self.exit_policy is not None:
            token = self.exit_policy(group.end - 1, layer, out)
            if token is None:
                return
        elif out.prob[0] < self.thresholds[layer]:  # the head's confidence: never depends on a draw
            if self.speculation is not None:
                self.speculation.head_called(layer, exited=False)
            return
        elif self.sampling is None:
            token = out.token[0]
        else:
            token = self.draw_proposal(group.end - 1, layer, out)
        if self.speculation is not None:
            self.speculation.head_called(layer, exited=True)
        stats = self.stats
        self.tokens.append(token)
        self.source_of[group.end - 1] = layer
        stats.exits_per_layer[layer] = stats.exits_per_layer.get(layer, 0) + 1
        with self.lock:
            self.frontier = None
            self.start_frontier(group.end, token)
            self.progress()

    def draw_proposal(self, position: int, layer: int, out: HeadOutput) -> int:
        """Sampling: draw the early token for position `position` from the exit head's own distribution q
        (the same temperature, top-k and top-p), and keep q for its verification."""
        q = distribution(out.logits[0], self.sampling)
        index = self.draws.choice(q, position, PROPOSE)
        ids = self.exit_vocab if self.exit_head[layer] != "final" else None
        self.proposals[position] = Proposal(ids, q)
        return int(ids[index]) if ids is not None else index

    # --- side lanes ---------------------------------------------------------------------------
    def side_worker(self, lane: str) -> None:
        while True:
            with self.lock:
                group = None
                while group is None:
                    if self.stopping:
                        return
                    group = self.claim(order="earliest")
                    if group is None:
                        self.work.wait(WAIT_SECONDS)  # idle until there is pending work; stopping wakes it
                epoch, layer, hidden, start = self.epoch, group.depth + 1, group.hidden, group.start
                self.in_flight += 1
            final, error = None, None
            try:
                out = self.ctx.layer(lane, layer, hidden, start)
                if layer == self.L:
                    final = self.ctx.head(lane, "final", out, start, logits=self.sampling is not None)
                self.publish()
            except BaseException as err:  # handed to lane 0, which raises it
                error = err
            with self.lock:
                self.in_flight -= 1
                try:
                    if error is None and epoch == self.epoch:
                        group.hidden, group.depth, group.busy, group.final = out, layer, False, final
                        self.ctx.cache.written(layer, group.end)
                except BaseException as err:  # e.g. a cache past its capacity: lane 0 raises it
                    error = err
                if error is not None:
                    self.error, self.stopping = error, True
                self.progress()
            if error is not None:
                return

    def raise_side_error(self) -> None:
        """Raise a side lane's error in lane 0 (lock held)."""
        if self.error is not None:
            raise self.error

    # --- verification -------------------------------------------------------------------------
    def verify_finished(self) -> list[tuple[int, float]]:
        """Verify, in position order, every group that has its final head; roll back on a mismatch."""
        verified: list[tuple[int, float]] = []
        stats = self.stats
        with self.lock:
            while self.groups and self.groups[0].final is not None:
                group = self.groups.pop(0)
                if self.ctx.annotate is not None:
                    now = time.perf_counter()
                    self.ctx.timeline.add("phases", "verify", now, now, (group.start, group.end))
                for i, position in enumerate(range(group.start, group.end)):
                    margin = group.final.margin[i]
                    if position + 1 < len(self.tokens):  # a proposed token is waiting for this verdict
                        source = self.source_of.pop(position)
                        accepted, token = self.judge(group.final, i, position)
                        depth = self.lookup_depth.pop(position, None)
                        if self.speculation is not None:
                            self.speculation.verified(source, accepted, depth)
                        if accepted:
                            stats.accept(source)
                            self.verified = position + 2
                            verified.append((token, margin))
                            continue
                        stats.mismatches.append(
                            Mismatch(position + 1, source, self.tokens[position + 1], token, margin)
                        )
                        with self.ctx.phase("rollback", (position + 1, len(self.tokens))):
                            self.rollback(position, token)
                        verified.append((token, margin))
                        self.index_verified()
                        return verified
                    if self.tokens[position] in self.stops.eos:  # a proposal ended with the EOS just verified
                        if group is self.frontier:
                            self.frontier = None
                        break
                    token = choose(group.final, i, position, self.sampling, self.draws)
                    self.tokens.append(token)  # the newest position: its final output is the next token
                    self.verified = position + 2
                    verified.append((token, margin))
                    if group is self.frontier:
                        self.frontier = None
                    self.index_verified()
                    self.start_frontier(position + 1, token)
        self.index_verified()
        return verified

    def judge(self, final: HeadOutput, index: int, position: int) -> tuple[bool, int]:
        """Verify the token proposed for position `position` + 1: (accepted, the token the sequence keeps).

        Greedy: accepted when it is the final head's top-1. Sampling: rejection sampling against the final
        distribution p (runtime/sampling.py), which keeps the sequence distributed exactly as ar sampling.
        """
        proposed = self.tokens[position + 1]
        proposal = self.proposals.pop(position, None)
        if self.sampling is None:
            return final.token[index] == proposed, final.token[index]
        p = distribution(final.logits[index], self.sampling)
        return verify(p, proposed, proposal, position, self.draws)

    def index_verified(self) -> None:
        if self.lookup is not None:
            self.lookup.extend(self.tokens, self.verified)

    def rollback(self, position: int, token: int) -> None:
        """tokens[position + 1] was wrong: discard every later position's work, continue from `token` (lock held)."""
        self.stats.rollbacks += 1
        self.epoch += 1
        self.groups, self.frontier = [], None
        while self.in_flight:  # their writes must land before new ones to the same slots
            self.wait(self.cond, "side-lane calls of discarded positions to finish")
        self.raise_side_error()
        del self.tokens[position + 1 :]
        self.tokens.append(token)
        self.verified = position + 2
        if self.speculation is not None:  # discarded lookup proposals were paid for: they count as rejected
            for q, source in self.source_of.items():
                if q > position and source == LOOKUP:
                    self.speculation.verified(LOOKUP, accepted=False)
        self.source_of = {q: e for q, e in self.source_of.items() if q < position}
        self.lookup_depth = {q: d for q, d in self.lookup_depth.items() if q < position}
        self.proposals = {q: v for q, v in self.proposals.items() if q < position}
        self.ctx.cache.rollback(position + 1)
        self.start_frontier(position + 1, token)
