"""Lanes: ordered queues of calls, run concurrently.

On a CPU a lane is a worker thread (onnxruntime and torch release the GIL while they compute, so
two lanes are real parallelism); on a GPU a lane also owns a CUDA stream, and a call counts as done
once its stream has finished it. The calling thread is lane 0 ("main") and runs its calls inline.
What the calls took is recorded in a `Timeline` (runtime/tracing.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
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
