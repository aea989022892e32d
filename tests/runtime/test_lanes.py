"""The lane machinery: order within a lane, real concurrency, errors."""

import threading

import pytest

from paradecode.runtime.lanes import Future, Lane
from paradecode.runtime.tracing import Timeline


@pytest.fixture
def lanes():
    made = [Lane("a"), Lane("b")]
    yield made
    for lane in made:
        lane.close()


def test_calls_on_one_lane_run_in_order(lanes):
    seen = []
    futures = [lanes[0].submit(seen.append, i) for i in range(20)]
    futures[-1].wait(5)
    assert seen == list(range(20))


def test_lanes_run_concurrently(lanes):
    """Each call waits for the other to start: only possible if both lanes run at the same time."""
    started = [threading.Event(), threading.Event()]

    def meet(mine, other):
        started[mine].set()
        return started[other].wait(5)

    a, b = lanes[0].submit(meet, 0, 1), lanes[1].submit(meet, 1, 0)
    assert a.wait(10) and b.wait(10)


def test_an_error_reaches_the_waiter_and_the_lane_keeps_working(lanes):
    def boom():
        raise ValueError("boom")

    failed = lanes[0].submit(boom)
    with pytest.raises(ValueError, match="boom"):
        failed.wait(5)
    assert lanes[0].submit(lambda: 42).wait(5) == 42


def test_future_timeout():
    with pytest.raises(TimeoutError):
        Future().wait(0.01)


def test_timeline_accounts_busy_time_per_lane():
    timeline = Timeline(record_spans=True)
    timeline.add("main", "layer_1", 1.0, 1.5, (0, 1))
    timeline.add("side1", "layer_2", 1.2, 1.4, (0, 1))
    timeline.add("main", "final", 1.5, 1.75, (0, 1))
    timeline.add("phases", "prefill", 1.0, 1.75, (0, 1))  # a phase is recorded, not counted as a call
    assert timeline.calls == 3 and len(timeline.spans) == 4
    assert timeline.busy["side1"] == pytest.approx(0.2)
    assert timeline.busy["main"] == pytest.approx(0.75)
