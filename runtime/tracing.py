"""What a request's calls took and what a measuring tool asks of them.

`Timeline` records every subgraph call (lane, name, positions, start, end): per-lane busy time for
the statistics, and the spans of a timeline trace. `Tracing` is what a measuring tool asks of one request.

Threading model: a `Timeline` is written by every lane's thread; its lock guards its spans, busy times and count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


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
