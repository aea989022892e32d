"""ParaDecode's `streams` and `both` overlaps: `ThreadedExecutor`, the executor of runtime/decoding.py with side
lanes beside lane 0 (docs/design.md §3, §5): worker threads (each with a CUDA stream on a GPU) that compute the next
layer of pending groups as soon as they can advance, while lane 0 computes the frontier. Every decision stays lane
0's and the planner's; the side lanes' calls and lane 0's run inside `Backend.sharing(lanes)`, so that computing at
once they share the cores rather than each taking all of them.

Threading model
---------------
One executor serves one request; its state is created in `__init__`.

- Lane 0 runs `run()`, makes every decision (exits, verdicts, rollbacks) and is the only one that
  computes the frontier. Side lanes (worker threads, one per extra lane) only compute the next layer of pending
  groups.
- Read-only after `__init__`: the settings (`ctx`, `prompt`, `stops`, `L`, `exits`, `sampler`'s parameters,
  `side_lanes`, `sync`) and the lock and its conditions.
- Lane 0's alone: the planner's own state (see runtime/planner.py), `waited`.
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

import torch

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime.decoding import Executor, HeadOutput
from paradecode.runtime.lanes import Future, Lane
from paradecode.runtime.planner import Group, Step

logger = logging.getLogger(__name__)

WAIT_SECONDS = 5.0  # one condition wait
STALL_SECONDS = 120.0  # no progress for this long is a bug: raise instead of hanging


class ThreadedExecutor(Executor):
    """Lane 0 with side lanes beside it (see the module's docstring)."""

    def __init__(self, *executor, side_lanes: list[Lane], **more):
        super().__init__(*executor, **more)  # an Executor's arguments
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
        # the side lanes write into the cache from their threads: it holds every slot before they start, and never
        # grows under them (runtime/kvcache.py)
        self.ctx.cache.reserve(self.ctx.cache.shape[2])
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
