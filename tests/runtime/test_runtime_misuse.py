"""Misuse of a loaded model ends cleanly: no hang, no broken model, clear errors (each under a timeout)."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from paradecode.graphs.errors import ModelClosedError, SchedulerStallError, UserInputError
from paradecode.runtime import GenerationConfig, load
from paradecode.runtime import overlaps as overlaps_module

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def model(exports):
    folder, _ = exports["llama"]
    with load(folder) as loaded:
        yield loaded


def still_works(model) -> None:
    result = model.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, thresholds=0.0, ignore_eos=True)
    assert len(result.token_ids) == 8


def test_two_streams_zipped_in_one_thread_each_decode_as_alone(model):
    """Each call decodes in an engine of its own (runtime/engine.py), so one thread's two open streams interleave
    (they once shared the model's cache and had to refuse this), each giving its request's tokens alone."""
    settings = dict(max_new_tokens=6, ignore_eos=True, thresholds=0.0)
    alone = [model.generate(prompt_ids=p, **settings).token_ids for p in ([1, 2], [3, 4, 5])]
    a = model.stream(prompt_ids=[1, 2], **settings)
    b = model.stream(prompt_ids=[3, 4, 5], mode="ar", **settings)
    pairs = list(zip(a, b))
    assert [[x.token for x, _ in pairs], [y.token for _, y in pairs]] == alone
    assert list(b) == []  # zip ended at a's end: b is asked once more for its end
    assert a.result.token_ids == alone[0] and b.result.token_ids == alone[1]
    assert len(model._idle) == 2  # both engines kept for the next calls
    still_works(model)


def test_threads_decode_at_once_on_one_model_each_as_alone(model):
    """No lock serialises a model's calls: threads decode at the same time (ar, ParaDecode batched and streams,
    sampling), each in its own engine, and each gets exactly what its request gives alone."""
    requests = [
        dict(prompt_ids=[1, 2, 3], mode="ar"),
        dict(prompt_ids=[4, 5], thresholds=0.0, overlap="batched"),
        dict(prompt_ids=[6], thresholds=0.0, overlap="streams"),
        dict(prompt_ids=[7, 8], thresholds=0.0, temperature=0.8, seed=3),
    ]
    settings = dict(max_new_tokens=24, ignore_eos=True)
    alone = [model.generate(**r, **settings).token_ids for r in requests]
    barrier, results, errors = threading.Barrier(len(requests)), {}, []
    inside = []  # how many threads were decoding when each token came out

    def decode(i):
        try:
            barrier.wait(30)
            with model.stream(**requests[i], **settings) as stream:
                for _ in stream:
                    inside.append(len(model._streams))
            results[i] = stream.result.token_ids
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert [results[i] for i in range(len(requests))] == alone
    assert max(inside) > 1, "the calls never overlapped"


def test_a_bad_request_leaves_the_thread_able_to_call_again(model):
    with pytest.raises(UserInputError, match="exit layers are"):
        model.generate(prompt_ids=[1], max_new_tokens=4, thresholds={9: 0.5})
    still_works(model)  # the same thread: its ownership of the model was never left set


def test_an_error_while_decoding_leaves_the_model_usable(model, monkeypatch):
    real = model.backend.run
    calls = []

    def failing(name, feeds, lane="main", outputs=None):
        calls.append(name)
        if len(calls) == 20:
            raise RuntimeError("device lost")
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(model.backend, "run", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=30, thresholds=0.0, ignore_eos=True)
    monkeypatch.setattr(model.backend, "run", real)
    still_works(model)


def test_close_while_another_thread_streams_ends_that_stream_and_later_calls_say_closed(exports):
    folder, _ = exports["llama"]
    model = load(folder)
    started, results, errors = threading.Event(), [], []

    def consume():
        try:
            with model.stream(prompt_ids=[1, 2, 3], max_new_tokens=5000, thresholds=0.0, ignore_eos=True) as s:
                for i, _ in enumerate(s):
                    if i == 2:
                        started.set()
                results.append(s.result)
        except Exception as err:  # reported below
            errors.append(err)

    worker = threading.Thread(target=consume)
    worker.start()
    assert started.wait(60)
    model.close()
    worker.join(60)
    assert not worker.is_alive()
    assert not errors, errors
    (result,) = results
    assert result.stats.stop_reason == "closed"
    assert 3 <= len(result.token_ids) < 5000
    with pytest.raises(ModelClosedError, match="closed"):
        model.generate(prompt_ids=[1], max_new_tokens=2)
    model.close()  # idempotent


def test_close_with_an_idle_stream_of_this_thread(exports):
    folder, _ = exports["llama"]
    model = load(folder)
    stream = model.stream(prompt_ids=[1, 2, 3], max_new_tokens=40, thresholds=0.0, overlap="streams", ignore_eos=True)
    next(stream), next(stream)  # the side lanes are working now
    model.close()
    assert list(stream) == []
    assert stream.result.stats.stop_reason == "closed"
    with pytest.raises(ModelClosedError):
        model.stream(prompt_ids=[1], max_new_tokens=2)


def test_a_stream_created_before_close_and_started_after_says_closed(exports):
    folder, _ = exports["llama"]
    model = load(folder)
    stream = model.stream(prompt_ids=[1, 2], max_new_tokens=4)
    model.close()
    with pytest.raises(ModelClosedError):
        next(stream)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prompt_ids": [1.5, 2]}, "integer token ids"),
        ({"prompt_ids": [True, 2]}, "integer token ids"),
        ({"prompt_ids": "1,2"}, "list of integer token ids"),
        ({"prompt_ids": [1], "max_new_tokens": True}, "max_new_tokens"),
        ({"prompt_ids": [1], "max_new_tokens": 2.0}, "max_new_tokens"),
        ({"prompt_ids": [1], "max_unverified": False}, "max_unverified"),
        ({"prompt_ids": [1], "thresholds": True}, "threshold"),
        ({"prompt_ids": [1], "thresholds": "0.5"}, "threshold"),
        ({"prompt_ids": [1], "thresholds": {"2": 0.5}}, "exit layer numbers"),
        ({"prompt_ids": [1], "stop": [1]}, "stop"),
        ({"prompt_ids": [1], "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": 42}, "prompt must be a string"),
    ],
)
def test_input_types_are_checked_never_truncated(model, settings, message):
    with pytest.raises(UserInputError, match=message):
        model.generate(**settings)
    still_works(model)


def test_numpy_integer_ids_are_fine(model):
    result = model.generate(prompt_ids=np.array([1, 2, 3]), max_new_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3


def test_a_stop_string_given_as_a_string_is_one_stop_string():
    assert GenerationConfig(stop="abc").stop == ("abc",)
    assert GenerationConfig(stop=["a", "bc"]).stop == ("a", "bc")


def test_bindings_are_bounded_by_lanes_and_live_threads(model):
    """A thread's bindings (runtime/backends/onnxruntime_backend.py) go with it: calls from many short-lived threads
    leave no more behind than one thread's."""

    def call():
        model.generate(prompt_ids=[1, 2], max_new_tokens=3, ignore_eos=True)

    def bound():
        return sum(len(bindings) for bindings in model.backend._bindings)

    call()
    before = bound()
    assert before > 0
    for _ in range(20):
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    gc.collect()
    assert bound() == before


def test_a_stall_raises_a_named_error_not_a_hang(model, monkeypatch):
    monkeypatch.setattr(overlaps_module, "WAIT_SECONDS", 0.05)
    monkeypatch.setattr(overlaps_module, "STALL_SECONDS", 0.3)
    real = model.backend.run

    def slow_side_lane(name, feeds, lane="main", outputs=None):
        if lane != "main":
            time.sleep(1.5)
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(model.backend, "run", slow_side_lane)
    with pytest.raises(SchedulerStallError, match="no progress for 0.3 s while lane 0 waited for"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=30, thresholds=0.0, overlap="streams", ignore_eos=True)
    monkeypatch.setattr(model.backend, "run", real)
    still_works(model)


def test_the_first_error_is_not_hidden_by_a_side_lane_that_does_not_stop(model, monkeypatch, caplog):
    monkeypatch.setattr(overlaps_module, "STALL_SECONDS", 0.3)
    real = model.backend.run
    calls = []

    def run(name, feeds, lane="main", outputs=None):
        if lane != "main":
            time.sleep(1.0)  # longer than the side lanes are given to stop
            return real(name, feeds, lane, outputs)
        calls.append(name)
        if len(calls) == 25:
            raise RuntimeError("the first error")
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(model.backend, "run", run)
    with pytest.raises(RuntimeError, match="the first error"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=40, thresholds=0.0, overlap="streams", ignore_eos=True)
    assert "did not stop" in caplog.text
    monkeypatch.setattr(model.backend, "run", real)
    time.sleep(1.5)  # let the slow side-lane call finish before the model is used again
    still_works(model)


def test_a_call_whose_engine_cannot_be_made_fails_alone_and_close_does_not_wait_for_it(exports, monkeypatch):
    """A call's engine (its KV cache) is made at its first token request: a failure there (no memory) is that call's
    error, and the model neither keeps it as an open stream nor waits for it when it closes."""
    from paradecode.runtime import model as model_module

    folder, _ = exports["llama"]
    model = load(folder)

    def no_memory(model, rows=1):
        raise MemoryError("no room for the KV cache")

    with monkeypatch.context() as patched:
        patched.setattr(model_module, "Engine", no_memory)
        with pytest.raises(MemoryError, match="KV cache"):
            model.generate(prompt_ids=[1, 2], max_new_tokens=4)
        assert not model._streams
    still_works(model)
    started = time.monotonic()
    model.close()
    assert time.monotonic() - started < 5
