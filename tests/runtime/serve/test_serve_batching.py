"""paradecode-serve batching concurrent requests (runtime/engine.py behind runtime/serve/pool.py): one replica,
one copy of the weights, several requests per step. Every answer under concurrency equals the same request decoded
alone (`model.generate`); cancellations, disconnects, timeouts and bad requests touch only their own request.

The served export is the tiny random Llama of tests/runtime/conftest.py (max_batch 8, the export default).
`SlowSteps` slows every batch step so requests overlap in the batch deterministically.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from paradecode.runtime import load
from tests.serving import GENERATION, NAME, SlowSteps, wait_until

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Once upon a time there was", "The dog", "She said hello to the little bird and", "Why"]
CHAT = [{"role": "user", "content": "What is two plus two?"}]
SUCCESS = ("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "success")))
CANCELLED = ("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))


@pytest.fixture(scope="module")
def reference(served_export):
    with load(served_export) as model:
        yield model


def expected(reference, max_tokens: int, ignore_eos: bool = False, **prompt):
    return reference.generate(**prompt, config=GENERATION, max_new_tokens=max_tokens, ignore_eos=ignore_eos)


def stream_text(client, max_tokens: int, ignore_eos: bool = False, **prompt) -> tuple[str, list[int]]:
    """A streamed completion (chat for `messages`) through the openai client: its text and token ids."""
    if "messages" in prompt:
        chunks = client.chat.completions.create(
            model=NAME, messages=prompt["messages"], max_tokens=max_tokens, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), []
    chunks = client.completions.create(
        model=NAME,
        prompt=prompt["prompt"],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": ignore_eos},
    )
    text, ids = "", []
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            ids += getattr(chunk.choices[0], "token_ids", None) or []
    return text, ids


def test_concurrent_streams_of_mixed_lengths_equal_each_alone(serve, served_export, reference, monkeypatch):
    running = serve(served_export, replicas=1, max_queue=8)
    assert running.pool.rows == 8 and running.pool.max_admitted == 16
    SlowSteps(monkeypatch, 0.01)
    jobs = [({"prompt": p}, 6 + 9 * i) for i, p in enumerate(PROMPTS)] + [({"messages": CHAT}, 20)] * 2
    want = [expected(reference, n, **prompt) for prompt, n in jobs]
    client = running.openai()
    with ThreadPoolExecutor(len(jobs)) as executor:
        futures = [executor.submit(stream_text, client, n, **prompt) for prompt, n in jobs]
        got = [f.result(timeout=120) for f in futures]
    for (text, ids), result, (prompt, _) in zip(got, want, jobs):
        assert text == result.text
        if "prompt" in prompt:
            assert ids == result.token_ids
    metrics = running.metrics()
    assert metrics[("paradecode_batch_steps_total", (("calls", "together"),))] > 0  # decoded together
    assert metrics[("paradecode_generation_tokens_total", ())] == sum(len(r.token_ids) for r in want)
    assert running.pool.counts() == (0, 0)


def test_a_lone_request_decodes_with_all_of_paradecode(serve, served_export, reference):
    running = serve(served_export, replicas=1)
    want = expected(reference, 24, prompt=PROMPTS[0])
    response = running.openai().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24)
    assert response.choices[0].text == want.text
    assert sum(response.paradecode["exits_per_layer"].values()) > 0  # ParaDecode, alone in its batch
    metrics = running.metrics()
    assert metrics[("paradecode_batch_steps_total", (("calls", "alone"),))] == len(want.token_ids) - 1
    assert metrics[("paradecode_batch_steps_total", (("calls", "together"),))] == 0
    assert metrics[("paradecode_batch_size", ())] == 1  # in its last step, the request alone


def test_cancellations_and_disconnects_mid_batch_free_their_rows(serve, served_export, reference, monkeypatch):
    running = serve(served_export, replicas=1)
    SlowSteps(monkeypatch, 0.05)
    long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 48, "ignore_eos": True, "stream": True}
    want = expected(reference, 40, ignore_eos=True, prompt=PROMPTS[2])
    with ThreadPoolExecutor(1) as executor:
        good = executor.submit(stream_text, running.openai(), 40, ignore_eos=True, prompt=PROMPTS[2])
        wait_until(lambda: running.pool.counts()[1] == 1, what="the good request decoding")
        streamed = running.http.send(running.http.build_request("POST", "/v1/completions", json=long), stream=True)
        lines = streamed.iter_lines()  # kept: a dropped iterator closes the response (httpx), cancelling it
        assert streamed.status_code == 200 and next(lines).startswith("data: ")
        body = json.dumps({**long, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", running.port)) as raw:  # a whole response, abandoned
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(lambda: running.pool.counts()[1] == 3, what="three requests in the batch")
        streamed.close()  # the streaming client leaves too
        wait_until(lambda: running.pool.counts()[1] == 1, 5, "both rows freed while the good request decodes")
        text, ids = good.result(timeout=60)
    assert text == want.text and ids == want.token_ids
    metrics = running.metrics()
    assert metrics[CANCELLED] == 2 and metrics[SUCCESS] == 1
    assert running.pool.counts() == (0, 0)


def test_a_bad_request_among_good_ones_in_a_batch(serve, served_export, reference, monkeypatch):
    running = serve(served_export, replicas=1, max_queue=4)
    SlowSteps(monkeypatch, 0.02)
    want = expected(reference, 30, prompt=PROMPTS[0])
    bad = [
        {"model": NAME, "prompt": "hi", "max_tokens": "x"},
        {"model": "nope", "prompt": "hi"},
        {"model": NAME, "prompt": "hi", "max_tokens": 10_000},
        b"{not json",
    ]
    with ThreadPoolExecutor(3) as executor:
        goods = [executor.submit(stream_text, running.openai(), 30, prompt=PROMPTS[0]) for _ in range(3)]
        wait_until(lambda: running.pool.counts()[1] == 3, what="three requests in the batch")
        statuses = [running.post("/v1/completions", body).status_code for body in bad]
        results = [future.result(timeout=60) for future in goods]
    assert statuses == [422, 404, 400, 400]
    assert results == [(want.text, want.token_ids)] * 3
    assert running.metrics()[SUCCESS] == 3


def test_a_timeout_in_a_batch_ends_only_that_request(serve, served_export, reference, monkeypatch):
    running = serve(served_export, replicas=1, request_timeout=1.5)
    SlowSteps(monkeypatch, 0.05)
    want = expected(reference, 8, prompt=PROMPTS[1])
    with ThreadPoolExecutor(1) as executor:
        slow = executor.submit(
            running.post, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 48, "ignore_eos": True}
        )
        wait_until(lambda: running.pool.counts()[1] == 1, what="the long request decoding")
        quick = running.openai().completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8)
        timed_out = slow.result(timeout=30)
    assert quick.choices[0].text == want.text
    assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "timeout"
    wait_until(lambda: running.pool.counts() == (0, 0), 5, "the timed-out row freed")


def test_a_full_batch_queues_and_a_full_queue_answers_429(serve, served_export, reference, monkeypatch):
    running = serve(served_export, replicas=1, max_batch=2, max_queue=1, retry_after=2)
    assert running.pool.max_admitted == 3
    SlowSteps(monkeypatch, 0.1)
    want = expected(reference, 12, prompt=PROMPTS[3])
    with ThreadPoolExecutor(3) as executor:
        decoding = [executor.submit(stream_text, running.openai(), 12, prompt=PROMPTS[3]) for _ in range(2)]
        wait_until(lambda: running.pool.counts() == (0, 2), what="a full batch of two")
        queued = executor.submit(stream_text, running.openai(), 12, prompt=PROMPTS[3])
        wait_until(lambda: running.pool.counts() == (1, 2), what="one request waiting")
        with pytest.raises(openai.RateLimitError):
            running.openai().completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=4)
        results = [f.result(timeout=60) for f in [*decoding, queued]]
    assert results == [(want.text, want.token_ids)] * 3


def test_requests_admitted_to_free_rows_count_as_running_never_as_waiting(served_export):
    """Jobs admitted while the worker is between steps sit in the pool's queue until it takes them (a few prompts a
    step), but a row is theirs: /health, the gauges and the 429 message count them as running, so waiting never
    exceeds --max-queue (a probe saw "11 request(s) are waiting (--max-queue 4)" with 12 admitted)."""
    import asyncio

    from paradecode.runtime.serve.errors import QueueFull
    from paradecode.runtime.serve.pool import Job, ReplicaPool
    from tests.serving import config_of

    pool = ReplicaPool(config_of(served_export, replicas=1, max_batch=4, max_queue=1))
    request = pool.models[0].request(prompt_ids=[1, 2, 3], config=GENERATION, max_new_tokens=2)
    try:

        async def scenario():
            loop = asyncio.get_running_loop()
            with pool._lock:  # the worker takes nothing while the jobs arrive
                depths = []
                for _ in range(5):
                    pool.submit(Job(request, loop))
                    depths.append(pool.counts())
                with pytest.raises(QueueFull) as refused:
                    pool.submit(Job(request, loop))
            return depths, str(refused.value)

        depths, message = asyncio.run(scenario())
    finally:
        pool.close()
    assert depths == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 4)]
    assert "and 1 request(s) are waiting (--max-queue 1)" in message


def test_a_batch_larger_than_the_export_holds_is_refused(served_export):
    from paradecode.graphs.errors import UserInputError
    from paradecode.runtime.serve.pool import ReplicaPool
    from tests.serving import config_of

    with pytest.raises(UserInputError, match="max_batch 9 is more rows than .* holds .*--max-batch 8"):
        ReplicaPool(config_of(served_export, max_batch=9))


def test_a_failing_batch_step_fails_its_requests_and_the_replica_goes_on(serve, served_export, reference, monkeypatch):
    from paradecode.runtime import engine as batching

    running = serve(served_export, replicas=1)
    real, calls = batching.Engine.step, []

    def broken_once(batch, *args, **kwargs):
        calls.append(batch.size)
        if len(calls) == 1:
            raise RuntimeError("a bug in the step")
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(batching.Engine, "step", broken_once)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True}
    failed = running.post("/v1/completions", body)
    assert failed.status_code == 500 and "a bug in the step" in failed.json()["error"]["message"]
    want = expected(reference, 8, prompt=PROMPTS[1])
    served = running.openai().completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8)
    assert served.choices[0].text == want.text and running.pool.counts() == (0, 0)


def test_serve_flags_set_batching_and_shared_lookup(served_export):
    from paradecode.runtime.serve import cli

    args = cli.build_parser().parse_args(
        [str(served_export), "--max-batch", "4", "--prefill-tokens", "64", "--shared-lookup"]
    )
    config, ray = cli.configs_of(args)
    assert ray is None and config.max_batch == 4 and config.prefill_tokens == 64
    assert config.generation.lookup_shared is True
    default, _ = cli.configs_of(cli.build_parser().parse_args([str(served_export)]))
    assert default.max_batch is None and default.generation.lookup_shared is False
    assert default.generation.adaptive is None
    for flag, adaptive in (("auto", None), ("on", True), ("off", False)):
        config, _ = cli.configs_of(cli.build_parser().parse_args([str(served_export), "--adaptive", flag]))
        assert config.generation.adaptive is adaptive


def test_a_batch_that_cannot_be_made_stops_the_start(served_export, monkeypatch):
    """A replica's batch (its KV-cache rows) is made when the pool starts: a failure there is the start's, and the
    models are freed, rather than a worker thread dying and its requests waiting for their timeout."""
    from paradecode.runtime.serve import pool as pool_module
    from tests.serving import config_of

    def no_memory(model, rows):
        raise MemoryError("no room for the KV-cache rows")

    monkeypatch.setattr(pool_module, "Engine", no_memory)
    loaded = []
    real_load = pool_module.load
    monkeypatch.setattr(pool_module, "load", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    with pytest.raises(MemoryError, match="KV-cache rows"):
        pool_module.ReplicaPool(config_of(served_export))
    assert loaded and all(model.closed for model in loaded)


def test_a_compiling_server_warms_every_replica_up_before_it_serves(served_export, monkeypatch):
    """`paradecode-serve --compile`: each replica compiles (ParaDecodeModel.warm_up, tested in test_torch_compile.py)
    in the pool's start, for the batch it will decode, so no request waits for a compilation."""
    from paradecode.runtime.model import ParaDecodeModel
    from paradecode.runtime.serve.pool import ReplicaPool
    from tests.serving import config_of

    warmed = []
    monkeypatch.setattr(
        ParaDecodeModel, "warm_up", lambda model, config=None, engine=None: warmed.append((model, config, engine))
    )
    config = config_of(served_export, backend="torch", torch_compile=True, replicas=2, max_batch=4)
    pool = ReplicaPool(config)
    try:  # each replica, with the server's settings, in the batch it will decode
        assert warmed == [(model, config.generation, batch) for model, batch in zip(pool.models, pool.engines)]
        assert all(model.backend.torch_compile and batch.rows == 4 for model, batch in zip(pool.models, pool.engines))
    finally:
        pool.close()
    plain = ReplicaPool(config_of(served_export, backend="torch", replicas=1))
    plain.close()
    assert len(warmed) == 2  # without --compile nothing is warmed up
