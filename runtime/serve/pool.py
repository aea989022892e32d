"""`ReplicaPool`: N loaded models, one worker thread each, fed from one bounded FIFO queue of jobs.

Threading model
---------------
- The event loop's thread (uvicorn's, or a Ray replica's) admits jobs (`submit`), cancels them
  (`cancel`) and reads their events from `job.events`, an `asyncio.Queue` that only it touches. It
  never calls a model: a model call blocks for as long as it decodes.
- One worker thread per replica (`paradecode-replica-I`) owns that replica's `Engine` (runtime/engine.py) over its
  `ParaDecodeModel`: only it steps the engine. It takes waiting jobs into the engine's free rows, the oldest first,
  and hands every verified token to the loop with `loop.call_soon_threadsafe`, which puts it on `job.events`; a
  slow client never holds a replica (its tokens wait in its own queue).
- `_lock` (a Condition the workers wait on) guards `_waiting` (the queue), `_running` (the jobs
  being decoded), every job's `state`, `_closing` and `_threads_joined`. Nothing else is shared: a job's prompt and
  config are immutable once submitted, and `job.cancelled` is a `threading.Event`.
- `cancel(job)` from any thread: a waiting job leaves the queue at once (its place frees); a running
  one has `cancelled` set, and it leaves its engine before the next step, after the token being computed (the
  runtime cannot stop a token half-way from another thread), which frees its row for the next job.
- `drain(reason)` (the server's shutdown timeout) refuses new jobs and fails every job at once with
  `ServiceUnavailable(reason)`: a waiting one leaves the queue, a running one is cancelled too (its
  worker stops after its token; the result it then emits comes after the error, unread).
- `close()` drains, joins the workers and closes the models.

A job carries its resolved `Request` (runtime/request.py: made and checked on a preparing thread) and receives the
engine's own events on its queue: each `StreamedToken`, then the `GenerationResult` or the error.

Batching: a replica's engine has as many rows as its export allows (`--max-batch`, ServeConfig.max_batch): its
worker takes waiting jobs into free rows between two steps (at most `prefill_tokens` prompt tokens of them per step,
and always one), and each step gives every job in the engine its next tokens (runtime/engine.py: ParaDecode
requests' lookup proposals are verified in the same calls as the other rows' tokens); a cancelled job leaves before
the next step, its row free at once. A replica of one row decodes one job at a time, as `model.stream` does.

Memory: each replica is a whole model: its own copy of the weights (one onnxruntime session per
subgraph, and the export's weights file as read at load) and its engine (a KV cache of its rows, and its lanes).
The replicas share one opened export (its manifest, and the check of its folder: runtime/watched.py), so they load
the same files.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from paradecode.graphs.errors import ParadecodeError
from paradecode.runtime.engine import ALONE, Engine, Sequence, StreamedToken
from paradecode.runtime.loader import open_export
from paradecode.runtime.model import ParaDecodeModel, load
from paradecode.runtime.request import Request
from paradecode.runtime.serve.config import ServeConfig
from paradecode.runtime.serve.errors import QueueFull, ServiceUnavailable, without_export_path
from paradecode.runtime.serve.memory import check_batches_fit, row_bytes
from paradecode.runtime.stats import GenerationResult

logger = logging.getLogger(__name__)

WAITING, RUNNING, DONE, CANCELLED = "waiting", "running", "done", "cancelled"


@dataclass(eq=False)
class Job:
    """One request's decoding: made on the event loop, run by a replica's worker."""

    request: Request
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)  # time.monotonic() when the request came in
    # StreamedToken..., then the GenerationResult or the error (without the export's path on this disk)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = WAITING  # under the pool's lock
    started: float | None = None  # set by the worker that takes the job

    @property
    def queue_seconds(self) -> float:
        return (self.started if self.started is not None else time.monotonic()) - self.arrived

    def emit(self, event) -> None:
        """From a worker: hand `event` to the loop. A closed loop (the server is gone) cancels the job."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()


class PoolMetrics:
    """What the pool reports as it works; `metrics.Metrics` implements it for Prometheus."""

    def depth(self, waiting: int, running: int) -> None: ...
    def started(self, queue_seconds: float) -> None: ...
    def token(self, seconds: float, first: bool) -> None: ...
    def step(self, size: int, alone: bool) -> None: ...
    def finished(self, result: GenerationResult) -> None: ...


class ReplicaPool:
    def __init__(self, config: ServeConfig, metrics: PoolMetrics | None = None):
        self.config = config
        self.metrics = metrics or PoolMetrics()
        self.models: list[ParaDecodeModel] = []
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._closing = False  # no new jobs (drained)
        self._threads_joined = False  # close() ran
        self._threads: list[threading.Thread] = []
        try:
            export = open_export(config.export, verify=config.verify)  # one export: the replicas load the same files
            for i in range(config.replicas):
                logger.info("loading replica %d/%d of %s", i + 1, config.replicas, config.export)
                self.models.append(load(export, **config.model_options()))
            self.rows = config.batch_rows(self.models[0].manifest.max_batch)  # jobs each replica decodes at once
            # the most the replicas' KV caches take, every row at max_seq_len (/health says it)
            self.kv_cache_bytes = row_bytes(self.models[0]) * self.rows * config.replicas
            if self.rows > 1:  # refused before allocating what the machine does not have
                reserved = check_batches_fit(self.models[0], self.rows, config.replicas, config.max_batch is not None)
                logger.info("%s", reserved)
            # each replica's engine (its KV-cache rows), made here so that a failure stops the start, not a worker
            self.engines = [Engine(model.runtime, self.rows) for model in self.models]
            if config.torch_compile:  # compile before listening, not in the first requests
                for i, model in enumerate(self.models):
                    logger.info("compiling replica %d/%d (torch.compile)", i + 1, config.replicas)
                    model.warm_up(config.generation, self.engines[i])
        except BaseException:
            for engine in getattr(self, "engines", ()):
                engine.free()
            for model in self.models:
                model.close()
            raise
        for i, (model, engine) in enumerate(zip(self.models, self.engines)):
            args = (model, engine)
            thread = threading.Thread(target=self._work, args=args, name=f"paradecode-replica-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        self.metrics.depth(0, 0)

    @property
    def max_admitted(self) -> int:
        """Jobs the pool admits at once: `rows` decoding per replica, plus the queue."""
        return self.config.replicas * self.rows + self.config.max_queue

    def counts(self) -> tuple[int, int]:
        """(waiting, running) jobs: see `_depth`."""
        with self._lock:
            return self._depth()

    def _depth(self) -> tuple[int, int]:
        """(waiting, running) under the lock. Running: every admitted job that a row holds or has room for (one the
        worker takes at its next step waits for nothing else: it joins in the order it came, a few prompts a step);
        waiting: the admitted jobs beyond every replica's rows, so never more than --max-queue."""
        admitted = len(self._waiting) + len(self._running)
        waiting = max(0, admitted - self.config.replicas * self.rows)
        return waiting, admitted - waiting

    # --- the event loop's side -----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull (every replica busy, the queue full) / ServiceUnavailable (closing)."""
        with self._lock:
            if self._closing:
                raise ServiceUnavailable("the server is shutting down; send the request to another replica or retry.")
            if len(self._waiting) + len(self._running) >= self.max_admitted:
                raise QueueFull(
                    f"all {self.config.replicas} replica(s) are busy ({self.rows} request(s) each) and "
                    f"{self._depth()[0]} request(s) are waiting "
                    f"(--max-queue {self.config.max_queue}); retry after {self.config.retry_after} s."
                )
            self._waiting.append(job)
            self._changed()
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """End `job` as soon as possible; nothing happens to a job that has finished."""
        with self._lock:
            if job.state == WAITING:
                self._waiting.remove(job)
                job.state = CANCELLED
                self._changed()
            elif job.state == RUNNING:
                job.cancelled.set()

    def drain(self, reason: str) -> int:
        """Refuse new jobs and fail every job now with ServiceUnavailable(reason); the number failed. Idempotent."""
        with self._lock:
            self._closing = True
            waiting, running = list(self._waiting), list(self._running)
            self._waiting.clear()
            for job in waiting:
                job.state = CANCELLED
                job.emit(ServiceUnavailable(f"{reason}; this request was waiting for a replica."))
            for job in running:
                if not job.cancelled.is_set():
                    job.cancelled.set()
                    job.emit(ServiceUnavailable(f"{reason}; this request was stopped while decoding."))
            self._changed()
            self._lock.notify_all()
        return len(waiting) + len(running)

    def close(self) -> None:
        """Fail every job (drain), stop the workers and free the models. Idempotent."""
        with self._lock:
            if self._threads_joined:
                return
            self._threads_joined = True
        self.drain("the server shut down")
        for thread in self._threads:  # each ends after the token it is computing
            thread.join()
        for engine in self.engines:
            engine.free()
        for model in self.models:
            model.close()
        logger.info("replicas closed")

    # --- the workers' side ---------------------------------------------------------------------
    def _changed(self) -> None:
        self.metrics.depth(*self._depth())

    def _take(self, engine: Engine) -> list[Job] | None:
        """Waiting jobs for `engine`'s free rows (the oldest first; their prompts within `prefill_tokens`, but at
        least one); waits while there is nothing to do. None once the pool closes and the engine is empty."""
        with self._lock:
            while not self._waiting and not engine.size and not self._closing:
                self._lock.wait()
            if self._closing and not engine.size:
                return None
            taken, tokens = [], 0
            while self._waiting and not self._closing and engine.size + len(taken) < engine.rows:
                tokens += len(self._waiting[0].request.ids)
                if taken and tokens > self.config.prefill_tokens:
                    break
                job = self._waiting.popleft()
                job.state = RUNNING
                job.started = time.monotonic()
                self._running.add(job)
                taken.append(job)
            if taken:
                self._changed()
            return taken

    def _work(self, model: ParaDecodeModel, engine: Engine) -> None:
        while (taken := self._take(engine)) is not None:
            try:
                self._step(model, engine, taken)
            except Exception as err:  # a bug, not a request's error (those end their own request): fail the engine's
                logger.exception("an engine step failed; its requests fail, the replica goes on")
                engine.close(err)

    def _step(self, model: ParaDecodeModel, engine: Engine, taken: list[Job]) -> None:
        """Join the `taken` jobs, then one step for every job in the engine."""
        for job in taken:
            self.metrics.started(job.queue_seconds)
            sink = self._sink(job)
            try:  # resolved and checked when it was prepared; a failure here fails the job alone
                engine.join(Sequence.of(job.request, sink, model.runtime, cancelled=job.cancelled.is_set))
            except Exception as err:  # the sink logs what is not a ParadecodeError
                sink(err)
        with self._lock:
            waiting = bool(self._waiting) and not self._closing
        if engine.size:
            size, alone = engine.size, engine.steps[ALONE]
            engine.step(waiting=waiting)
            if engine.rows > 1:
                self.metrics.step(size, alone=engine.steps[ALONE] > alone)

    def _sink(self, job: Job):
        """What a job's sequence in an engine hands over: its tokens to the loop, its end to the pool too."""
        last, first = job.arrived, True

        def sink(event) -> None:
            nonlocal last, first
            if isinstance(event, StreamedToken):
                now = time.monotonic()
                self.metrics.token(now - last, first=first)
                last, first = now, False
                job.emit(event)
                return
            if isinstance(event, GenerationResult):
                self.metrics.finished(event)
                job.emit(event)
            else:
                if not isinstance(event, ParadecodeError):
                    logger.error("decoding a request failed", exc_info=event)
                job.emit(without_export_path(event, self.config.export))
            with self._lock:
                job.state = DONE
                self._running.discard(job)
                self._changed()

        return sink
