"""Lanes: ordered queues of calls, run concurrently.

On a CPU a lane is a worker thread (onnxruntime and torch release the GIL while they compute, so
two lanes are real parallelism); on a GPU a lane also owns a CUDA stream, and a call counts as done
once its stream has finished it. The calling thread is lane 0 ("main") and runs its calls inline.

`Timeline` records every subgraph call (lane, name, positions, start, end): per-lane busy time for
the statistics, and the spans of a timeline trace. `Tracing` is what a measuring tool asks of one request.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


class Future:
    """The completion event and outcome of one submitted call."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def set(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("the call did not finish in time")
        if self._error is not None:
            raise self._error
        return self._result


class Lane:
    """A worker thread running submitted calls in order."""

    def __init__(self, name: str, stream: Any = None):
        self.name = name
        self.stream = stream  # a torch.cuda.Stream for GPU lanes, None on a CPU
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"paradecode-lane-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = Future()
        self._queue.put((fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, future = item
            try:
                with self.context():
                    result = fn(*args)
                    self.synchronize()
                future.set(result)
            except BaseException as err:  # handed to whoever waits on the future
                future.set(error=err)

    def context(self):
        if self.stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    positions: tuple[int, int]  # [first, last + 1)


class Timeline:
    """Records subgraph calls; thread-safe. Times are `time.perf_counter()` seconds."""

    def __init__(self, record_spans: bool = False):
        self.record_spans = record_spans
        self.spans: list[Span] = []
        self.busy: dict[str, float] = {}
        self.calls = 0
        self._lock = threading.Lock()

    def add(self, lane: str, name: str, start: float, end: float, positions: tuple[int, int]) -> None:
        with self._lock:
            self.calls += lane != "phases"
            self.busy[lane] = self.busy.get(lane, 0.0) + end - start
            if self.record_spans:
                self.spans.append(Span(lane, name, start, end, positions))


@dataclass(frozen=True)
class Tracing:
    """What a measuring tool asks of one request (`model.generate(..., tracing=Tracing(...))`), none of which
    changes its output; the default asks nothing and costs nothing (docs/measuring.md).

    `spans`: keep every subgraph call's `Span` in `result.timeline` (`paradecode-profile`'s trace).
    `annotate(name)`: a context-manager factory, such as an NVTX range, around every call and scheduler phase.
    `exit_policy(position, layer, head_output) -> token | None`: ParaDecode's exits decided by this instead of the
    thresholds (`paradecode-characterise` forces exits at a controlled rate; verification still decides every
    token, and adaptive speculation is off while it is set).
    """

    spans: bool = False
    annotate: Callable[[str], AbstractContextManager] | None = None
    exit_policy: Callable[[int, int, Any], int | None] | None = None


NO_TRACING = Tracing()
