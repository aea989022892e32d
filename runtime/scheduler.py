"""ParaDecode's executors: they make the calls the planner plans (docs/design.md §3).

`ParaDecoder` is the entry: for one request it builds the planner (runtime/planner.py: what each call computes),
the proposers (runtime/proposers.py) and an executor, and `run()` yields the verified tokens. An executor makes the
calls through a `DecodeContext`, hands their results to the planner, asks the exit heads for their proposals,
judges finished groups with `runtime.verification.verify`, and keeps the KV cache's lengths:

- `Executor`: lane 0 alone (`batched`, the default; `streams` or `both` without side lanes). A pending
  group's remaining layers run in the frontier's own calls once it reaches their depth (the two groups merge).
- `ThreadedExecutor`: the same, with side lanes beside it (`streams`, `both`): worker threads (each with a CUDA
  stream on a GPU) that compute the next layer of pending groups as soon as they can advance.

Threading model
---------------
One executor serves one generate call; its state is created in `__init__`. The `Executor` has one thread and no
lock. In a `ThreadedExecutor`:

- Lane 0 runs `run()`, makes every decision (exits, verdicts, rollbacks) and is the only one that
  computes the frontier. Side lanes (worker threads, one per extra lane) only compute the next layer of pending
  groups.
- Read-only after `__init__`: the settings (`ctx`, `prompt`, `stops`, `L`, `exits`, `sampler`'s parameters,
  `side_lanes`, `sync`) and the lock and its conditions.
- Lane 0's alone: the planner's own state (see runtime/planner.py), the sampler's drafts, `waited`.
- Guarded by `lock` (any lane reads or writes them only while holding it): the planner's `groups` and `frontier`
  and every field of their groups, `epoch`, `in_flight`, `stopping`, `error`, and the KV cache's lengths
  (`cache.written`, `cache.rollback`).
- Claiming: a lane takes a group by marking it `busy` under the lock (lane 0 owns the frontier without
  marking it). It then computes that group's next layers *without* the lock (no other lane touches a busy group or
  the frontier, and merging never takes a busy group), and publishes the result under the lock.
- A rollback (lane 0, under the lock) bumps `epoch` and waits until `in_flight` is zero, so a side
  lane's late result is dropped (its epoch is stale) and no stale cache write lands after a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime.completion import Stops
from paradecode.runtime.decoding import MAIN, DecodeContext, HeadOutput, prefill
from paradecode.runtime.lanes import Future, Lane
from paradecode.runtime.lookup import LookupConfig, SharedSuffixIndex
from paradecode.runtime.planner import Group, Planner, Step
from paradecode.runtime.proposers import ExitHeads, LookupProposer
from paradecode.runtime.sampling import Sampler, SamplingParams
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationStats
from paradecode.runtime.verification import verify

logger = logging.getLogger(__name__)

WAIT_SECONDS = 5.0  # one condition wait
STALL_SECONDS = 120.0  # no progress for this long is a bug: raise instead of hanging


class ParaDecoder:
    """ParaDecode of one request over `ctx` after `prompt`, until `stops` say so, counting into `stats`.

    `thresholds`: per exit layer (above 1: never); `max_unverified`: K; `overlap`: `batched`, `streams` or `both`,
    with `side_lanes` for the latter two; `exit_policy`: replaces the threshold test, for measurements only
    (tools/characterise.py); `lookup` / `shared`: lookup proposals from the request's tokens / earlier requests';
    `sampling`: None is greedy; `speculation`: adaptive speculation's estimates (None: always exit and propose).
    """

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
        sampler = Sampler(sampling, ctx.backend.exit_vocab()) if sampling is not None else None
        exits = ExitHeads(thresholds, ctx.backend.subgraph_names, sampler, exit_policy)
        self.planner = Planner(
            prompt,
            num_layers=ctx.num_layers,
            exits=exits,
            max_unverified=max_unverified,
            merge=overlap in ("batched", "both"),
            last_position=stops.last_position - 1,
            eos=stops.eos,
            stats=stats,
            lookup=LookupProposer(lookup, shared) if lookup is not None else None,
            speculation=speculation,
            join=_join,
        )
        lanes = side_lanes if overlap in ("streams", "both") else []
        if lanes:
            self.executor = ThreadedExecutor(ctx, prompt, stops, self.planner, exits, sampler, side_lanes=lanes)
        else:
            self.executor = Executor(ctx, prompt, stops, self.planner, exits, sampler)

    def run(self, resume: int | None = None) -> Iterator[tuple[int, float, str | None]]:
        """The verified tokens after the prompt, the first from its prefill, each with the stop decision after it
        (`Stops`): it ends after the one that stops. `resume`: the prompt is already in the cache at every layer (a
        batch hands a request back to ParaDecode) and `resume` is the token after it, verified and already
        returned: decoding goes on from there, yielding only the tokens after it."""
        return self.executor.run(resume)


def _join(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Two consecutive groups' hidden states [1, T, D] as one group's."""
    return torch.cat([before, after], dim=1)


class Executor:
    """Lane 0 alone: each step computes one group as far as it can go (see the module's docstring)."""

    def __init__(
        self,
        ctx: DecodeContext,
        prompt: list[int],
        stops: Stops,
        planner: Planner,
        exits: ExitHeads,
        sampler: Sampler | None,
    ):
        self.ctx = ctx
        self.prompt = list(prompt)
        self.stops = stops
        self.planner = planner
        self.exits = exits
        self.sampler = sampler  # None: greedy
        self.logits = sampler is not None  # the heads' logits are needed (sampling)
        self.L = ctx.num_layers
        self.sync = ctx.backend.device.type == "cuda"  # publish GPU results only once their stream is done

    # --- the generator lane 0 runs ------------------------------------------------------------------------------------
    def run(self, resume: int | None = None) -> Iterator[tuple[int, float, str | None]]:
        """See `ParaDecoder.run`."""
        planner, n = self.planner, len(self.prompt)
        if resume is None:
            sampler = self.sampler
            params, draws = (sampler.params, sampler.draws) if sampler is not None else (None, None)
            token, margin = prefill(self.ctx, self.prompt, params, draws)
        else:
            token = resume
            for layer in range(1, self.L + 1):
                self.ctx.cache.written(layer, n)
        planner.begin(token)
        position = n  # the newest verified token's
        if resume is None:
            stop = self.stops.after(token, position)
            yield token, margin, stop
            if stop is not None:
                return
        planner.start_frontier(n, token)
        self.start_side_lanes()
        failed = False
        try:
            while True:
                for token, margin in self.verify_finished():
                    position += 1
                    stop = self.stops.after(token, position)
                    yield token, margin, stop
                    if stop is not None:
                        return  # nothing after it was started (the planner's `start_frontier`, `propose`, `settle`)
                self.step()
        except BaseException:  # closing early (GeneratorExit) included: the stop below must not mask it
            failed = True
            raise
        finally:
            self.stop_side_lanes(raise_errors=not failed)

    def step(self) -> None:
        """Compute the planner's next step (`Planner.next_step`) and hand it the results."""
        step = self.plan()
        if step is None:
            return
        group, last, exit_now, fused = step
        ctx, start, end, depth, hidden = self.ctx, group.start, group.end, group.depth, group.hidden
        first, final, early = depth + 1, None, None
        if depth == -1:
            hidden, depth, first = ctx.embed(MAIN, self.planner.tokens[start:end], start), 0, 1
        if depth < last - fused:  # the layers before: segments where they cover them, else one call each
            hidden, depth = ctx.layers(MAIN, depth + 1, last - fused, hidden, start), last - fused
        if fused and depth < last:  # the exit layer in one call with its head
            hidden, early = ctx.layer_exit(MAIN, last, hidden, start)
            depth = last
        if depth == self.L:
            final = ctx.head(MAIN, "final", hidden, start, logits=self.logits)
        self.publish()
        self.computed(group, first, depth, hidden, final)
        if exit_now and depth == last:
            if early is None:
                early = ctx.head(MAIN, self.exits.head[last], hidden[:, -1:], end - 1, logits=self.logits)
            self.exited(group, last, self.exits.propose(end - 1, last, early))

    def plan(self) -> Step | None:
        step = self.planner.next_step()
        if step is None:  # only a side lane could advance a group, and there is none
            raise SchedulerStallError(
                f"the ParaDecode scheduler has nothing to compute (groups: {self.describe()}). This is a bug: "
                "please report it with the settings used."
            )
        return step

    def computed(self, group: Group, first: int, depth: int, hidden: torch.Tensor, final: HeadOutput | None) -> None:
        """`group` computed layers first..depth: the cache holds them, the planner has the result."""
        for layer in range(first, depth + 1):
            self.ctx.cache.written(layer, group.end)
        self.planner.computed(group, depth, hidden, final)

    def exited(self, group: Group, layer: int, token: int | None) -> None:
        self.planner.exit_proposed(group, layer, token)

    def publish(self) -> None:
        """On a GPU, wait for this lane's stream so another lane may read what it computed (lane 0
        alone waits too, as it always has: whether it can skip that is not measured)."""
        if self.sync:
            torch.cuda.current_stream().synchronize()

    # --- verdicts -----------------------------------------------------------------------------------------------------
    def verify_finished(self) -> list[tuple[int, float]]:
        """Verify, in position order, every group that has its final head's output; roll back on a rejection."""
        verified: list[tuple[int, float]] = []
        planner, ctx = self.planner, self.ctx
        while (group := planner.take_verifiable()) is not None:
            if ctx.annotate is not None:
                now = time.perf_counter()
                ctx.timeline.add("phases", "verify", now, now, (group.start, group.end))
            bonus = planner.wants_successor(group)
            accepted, token = verify(group.final, planner.tokens, group.start, group.end, bonus, self.sampler)
            position = planner.settle(group, accepted, token, verified)
            if position >= 0:
                with ctx.phase("rollback", (position + 1, len(planner.tokens))):
                    self.rollback(position, token)
                verified.append((token, group.final.margin[accepted]))
                planner.index_verified()
                return verified
        planner.index_verified()
        return verified

    def rollback(self, position: int, token: int) -> None:
        """tokens[position + 1] was wrong: the planner continues from `token`, the cache forgets the later positions."""
        self.planner.rollback(position, token)
        self.discard_in_flight()
        self.ctx.cache.rollback(position + 1)
        if self.sampler is not None:
            self.sampler.discard_from(position)

    def discard_in_flight(self) -> None:
        """Make sure no call of a discarded position is still to land (none: every call here has)."""

    def describe(self) -> str:
        return ", ".join(f"{g.start}-{g.end - 1}@{g.depth}{' busy' if g.busy else ''}" for g in self.planner.groups)

    # --- side lanes: none here ----------------------------------------------------------------------------------------
    def start_side_lanes(self) -> None:
        pass

    def stop_side_lanes(self, *, raise_errors: bool) -> None:
        pass


class ThreadedExecutor(Executor):
    """Lane 0 with side lanes beside it (see the module's docstring)."""

    def __init__(self, *executor, side_lanes: list[Lane]):
        super().__init__(*executor)  # an Executor's arguments
        self.side_lanes = side_lanes
        # One lock, two conditions: lane 0 waits on `cond`; side lanes wait on `work`, which is only
        # signalled when pending groups exist, so idle side lanes cost nothing when nothing exits.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.work = threading.Condition(self.lock)
        self.waited = 0.0  # seconds lane 0 has waited without progress
        self.workers: list[Future] = []
        # Guarded by `lock`.
        self.epoch = 0  # bumped by every rollback and at the end: results of an older epoch are dropped
        self.in_flight = 0  # side-lane calls running
        self.stopping = False
        self.error: BaseException | None = None  # a side lane's error, raised by lane 0

    # --- lane 0: the base's steps, under the lock where they touch shared state ---------------------------------------
    def step(self) -> None:
        with self.ctx.backend.sharing(1 + len(self.side_lanes)):  # the side lanes compute at the same time
            super().step()

    def plan(self) -> Step | None:
        with self.lock:
            self.raise_side_error()
            step = self.planner.next_step()
            if step is None:
                self.wait(self.cond, "a pending group to be computed by a side lane")
            return step

    def computed(self, group: Group, first: int, depth: int, hidden: torch.Tensor, final: HeadOutput | None) -> None:
        with self.lock:
            super().computed(group, first, depth, hidden, final)
            self.progress()

    def exited(self, group: Group, layer: int, token: int | None) -> None:
        if token is None:  # no exit: only lane 0's state changes
            self.planner.exit_proposed(group, layer, None)
            return
        with self.lock:
            self.planner.exit_proposed(group, layer, token)
            self.progress()

    def verify_finished(self) -> list[tuple[int, float]]:
        with self.lock:
            return super().verify_finished()

    def discard_in_flight(self) -> None:
        """Drop the results of side-lane calls still running, and wait for them: their cache writes must land
        before new ones to the same slots (lock held)."""
        self.epoch += 1
        while self.in_flight:
            self.wait(self.cond, "side-lane calls of discarded positions to finish")
        self.raise_side_error()

    def wait(self, condition: threading.Condition, what: str) -> None:
        """Wait for progress (lock held); a stall of STALL_SECONDS is an error naming `what`, not a hang."""
        if condition.wait(WAIT_SECONDS):
            self.waited = 0.0
            return
        self.waited += WAIT_SECONDS
        if self.waited >= STALL_SECONDS:
            raise SchedulerStallError(
                f"the ParaDecode scheduler made no progress for {STALL_SECONDS:g} s while lane 0 waited for "
                f"{what} (groups: {self.describe() or 'none'}; side-lane calls in flight: {self.in_flight}). This "
                "is a bug: please report it with the settings used."
            )

    def progress(self) -> None:
        """Wake whoever may now proceed (lock held): lane 0 always, side lanes when there is work."""
        self.cond.notify_all()
        if self.stopping or self.planner.has_pending():
            self.work.notify_all()

    def raise_side_error(self) -> None:
        """Raise a side lane's error in lane 0 (lock held)."""
        if self.error is not None:
            raise self.error

    # --- side lanes ---------------------------------------------------------------------------------------------------
    def start_side_lanes(self) -> None:
        self.workers = [lane.submit(self.side_worker, lane.name) for lane in self.side_lanes]

    def stop_side_lanes(self, *, raise_errors: bool) -> None:
        """Tell the side lanes to stop and wait for them. With an error already propagating, a lane that
        does not stop is logged, never raised: the first error is the one the caller sees."""
        with self.lock:
            self.stopping = True
            self.epoch += 1
            self.progress()
        for lane, worker in zip(self.side_lanes, self.workers):
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

    def side_worker(self, lane: str) -> None:
        """A side lane: compute the next layer of the earliest pending group that can advance, until stopped."""
        planner, ctx = self.planner, self.ctx
        while True:
            with self.lock:
                group = None
                while group is None:
                    if self.stopping:
                        return
                    group = planner.claim(latest=False)
                    if group is None:
                        self.work.wait(WAIT_SECONDS)  # idle until there is pending work; stopping wakes it
                epoch, layer, hidden, start = self.epoch, group.depth + 1, group.hidden, group.start
                self.in_flight += 1
            final, error = None, None
            try:
                with ctx.backend.sharing(1 + len(self.side_lanes)):
                    out = ctx.layer(lane, layer, hidden, start)
                    if layer == self.L:
                        final = ctx.head(lane, "final", out, start, logits=self.logits)
                self.publish()
            except BaseException as err:  # handed to lane 0, which raises it
                error = err
            with self.lock:
                self.in_flight -= 1
                try:
                    if error is None and epoch == self.epoch:
                        planner.computed(group, layer, out, final)
                        ctx.cache.written(layer, group.end)
                except BaseException as err:  # e.g. a cache past its capacity: lane 0 raises it
                    error = err
                if error is not None:
                    self.error, self.stopping = error, True
                self.progress()
            if error is not None:
                return
