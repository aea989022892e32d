"""paradecode-serve: the OpenAI HTTP API over a real uvicorn server on a free localhost port.

Clients: the `openai` Python client, and httpx where a test needs the raw status, headers or body.
Outputs are compared token for token with `model.generate` on the same export. The export is a tiny
random Llama with a Llama 3 style tokenizer and chat template (`served_export`, tests/runtime/conftest.py);
exports/llama from conftest (no tokenizer) serves token-id prompts. Slow replicas are made with
`SlowStreams` (a delay between tokens), so queueing, timeouts and disconnects are deterministic.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig, load
from paradecode.runtime.serve.bodies import CONFIG_FIELDS
from paradecode.runtime.serve.config import ServeConfig
from paradecode.runtime.stops import StopText
from tests.conftest import REPO
from tests.runtime.test_chat import with_file, without_template
from tests.serving import GENERATION, NAME, SEQ_LEN, Server, SlowStreams, config_of, free_port, sse_events, wait_until

pytestmark = pytest.mark.timeout(300)

PROMPT = "Once upon a time there was"
LONG_RUN = 48  # new tokens that fit after PROMPT
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def reference(served_export):
    with load(served_export) as model:
        yield model


@pytest.fixture(scope="module")
def server(served_export):
    """Two replicas, shared by the tests that only send requests."""
    running = Server(config_of(served_export, replicas=2))
    yield running
    running.close()


def expected(reference, max_tokens: int, **prompt):
    return reference.generate(**prompt, config=GENERATION, max_new_tokens=max_tokens)


def check_stats(stats: dict, result) -> None:
    """The response's `paradecode` field against the same request's GenerationResult."""
    assert stats["exits_per_layer"] == {str(k): v for k, v in result.stats.exits_per_layer.items()}
    assert stats["accepted_per_layer"] == {str(k): v for k, v in result.stats.accepted_per_layer.items()}
    assert (stats["lookup_proposed"], stats["lookup_accepted"]) == (
        result.stats.lookup_proposed,
        result.stats.lookup_accepted,
    )
    assert stats["rollbacks"] == result.stats.rollbacks
    assert sum(stats["exits_per_layer"].values()) > 0 and stats["mode"] == "paradecode"


# --- the API, against model.generate ------------------------------------------------------------------------------


def test_models_and_health(server, served_export):
    (card,) = server.openai().models.list().data
    assert card.id == NAME and card.owned_by == "paradecode"
    assert card.max_model_len == SEQ_LEN and card.root == NAME  # never the export's path on the server's disk
    assert str(served_export) not in server.http.get("/v1/models").text
    health = server.http.get("/health")
    state = health.json()
    reserved = state.pop("kv_cache_bytes_max")
    assert health.status_code == 200 and state == {"status": "ok", "replicas": 2, "waiting": 0, "running": 0}
    from paradecode.runtime import load
    from paradecode.runtime.serve.memory import row_bytes

    with load(served_export) as model:  # two replicas of the export's rows at max_seq_len
        assert reserved == 2 * model.manifest.max_batch * row_bytes(model)


def test_completions_equal_generate(server, reference):
    want = expected(reference, 20, prompt=PROMPT)
    response = server.openai().completions.create(
        model=NAME, prompt=PROMPT, max_tokens=20, extra_body={"return_token_ids": True}
    )
    (choice,) = response.choices
    assert choice.token_ids == want.token_ids and choice.text == want.text
    assert response.prompt_token_ids == reference.prompt_ids(PROMPT)
    assert response.usage.prompt_tokens == len(reference.prompt_ids(PROMPT))
    assert response.usage.completion_tokens == len(want.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert choice.finish_reason == ("stop" if want.stats.stop_reason == "eos" else "length")
    assert response.object == "text_completion" and response.id.startswith("cmpl-") and response.model == NAME
    check_stats(response.paradecode, want)


def test_completions_stream_equal_generate(server, reference):
    want = expected(reference, 24, prompt=PROMPT)
    chunks = list(
        server.openai().completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    *pieces, last, usage = chunks
    assert "".join(c.choices[0].text for c in [*pieces, last]) == want.text
    assert [c.choices[0].token_ids for c in pieces] == [[t] for t in want.token_ids]  # a chunk per verified token
    assert all(c.choices[0].finish_reason is None for c in pieces) and last.choices[0].finish_reason is not None
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in [*pieces, last])
    check_stats(last.paradecode, want)


def test_chat_equal_generate_whole_and_streamed(server, reference):
    want = expected(reference, 20, messages=CHAT)
    client = server.openai()
    response = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=20)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.choices[0].message.role == "assistant" and response.choices[0].message.content == want.text
    assert response.usage.prompt_tokens == len(reference.prompt_ids(messages=CHAT))
    assert response.usage.completion_tokens == len(want.token_ids)
    check_stats(response.paradecode, want)

    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_chat_with_text_parts_and_defaults(server, reference):
    """Content as OpenAI's text parts; without max_tokens a chat may use the rest of the context (vLLM's default)."""
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    want = reference.generate(messages=CHAT, config=GENERATION, max_new_tokens=SEQ_LEN)  # to the cache's end
    response = server.openai().chat.completions.create(model=NAME, messages=parts, temperature=0, top_p=1, seed=7)
    assert response.choices[0].message.content == want.text
    assert response.usage.completion_tokens == len(want.token_ids)
    completion = server.post("/v1/completions", {"model": NAME, "prompt": PROMPT}).json()
    assert completion["usage"]["completion_tokens"] == len(expected(reference, 16, prompt=PROMPT).token_ids)


def test_stop_strings_cut_the_text_whole_and_streamed(server, reference):
    full = reference.generate(PROMPT, config=GENERATION, max_new_tokens=40, ignore_eos=True).text
    stop = full[12:15]
    assert stop.strip(), f"pick a stop string with text in it: {full!r}"
    want = full[: full.find(stop)]
    client = server.openai()
    body = dict(
        model=NAME, prompt=PROMPT, max_tokens=40, stop=[stop, "never appears \u2603"], extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**body)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].stop_reason == stop
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 40  # decoding stopped there, not at max_tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", ["Lily.", "a stop string far longer than four characters", ["Lily.", "x"]])
def test_stop_is_a_string_of_any_length_or_a_list(server, reference, stop):
    """OpenAI clients send `stop` as one string: the 4-item limit is a list's, never a string's characters."""
    full = reference.generate(PROMPT, config=GENERATION, max_new_tokens=12, ignore_eos=True).text
    response = server.post(
        "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stop": stop}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == full  # none of these stop strings is in the text


def test_max_tokens_and_ignore_eos(server):
    response = server.openai().completions.create(
        model=NAME, prompt=PROMPT, max_tokens=SEQ_LEN - 8, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == SEQ_LEN - 8 and response.choices[0].finish_reason == "length"
    assert response.paradecode["stop_reason"] == "max_new_tokens"


def test_token_id_prompts_on_an_export_without_a_tokenizer(serve, exports):
    folder, _ = exports["llama"]
    running = serve(folder, replicas=1)
    with load(folder) as model:
        want = model.generate(prompt_ids=[1, 5, 9], config=GENERATION, max_new_tokens=12, ignore_eos=True)
    for prompt in ([1, 5, 9], [[1, 5, 9]]):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
        response = running.post("/v1/completions", body).json()
        assert response["choices"][0]["token_ids"] == want.token_ids and response["choices"][0]["text"] == ""
    lines = running.post("/v1/completions", {**body, "stream": True}).text.splitlines()
    *chunks, done = sse_events(lines)
    assert done == "[DONE]" and [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    refused = running.post("/v1/completions", {"model": NAME, "prompt": "text"})
    assert refused.status_code == 400 and "no tokenizer: send the prompt as a list of token ids" in refused.text
    outside = running.post("/v1/completions", {"model": NAME, "prompt": [1, 10_000]})
    assert outside.status_code == 400 and "outside the vocabulary" in outside.text
    stop = running.post("/v1/completions", {"model": NAME, "prompt": [1, 5, 9], "stop": "x"})  # not silently ignored
    assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop" and "tokenizer" in stop.text
    assert "need the export's tokenizer to read the output as text, and export has none" in stop.text  # the runtime's


# --- bad requests -------------------------------------------------------------------------------------------------

LONG = "Once upon a time " * 40  # more tokens than the export's 64


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code", "message"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found", "serves 'tiny-chat'"),
        ("/v1/completions", {"model": NAME, "prompt": LONG}, 413, "prompt", "context_length_exceeded", "holds \\(64 "),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": [{"role": "user", "content": LONG}]},
            413,
            "messages",
            "context_length_exceeded",
            "--max-seq-len",
        ),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "max_tokens": 500},
            400,
            "max_tokens",
            None,
            "at most 6\\d new tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": CHAT, "max_completion_tokens": 500},
            400,
            "max_completion_tokens",
            None,
            "KV cache holds 64 tokens",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "n": 2}, 400, "n", None, "send 1 or leave it out"),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "top_p": 0},
            422,
            "top_p",
            None,
            "greater than 0",
        ),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": CHAT, "logprobs": True},
            400,
            "logprobs",
            None,
            "not supported",
        ),
        ("/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt", None, "one prompt per request"),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "stop": ""}, 400, "stop", None, "must not be empty"),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
            422,
            "stop",
            None,
            "a string or a list of at most 4 strings",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "top_k": -2}, 422, "top_k", None, "greater than or equal"),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": [{"role": "user", "content": "hi", "name": "x"}]},
            400,
            "messages[0].name",
            None,
            "sees only role and content",
        ),
        ("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi"', 400, None, "invalid_json", "not valid JSON"),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "max_tokens": "ten"},
            422,
            "max_tokens",
            None,
            "valid integer; got str 'ten'",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 5.0}, 422, "max_tokens", None, "integer"),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, 422, "stream", None, "boolean"),
        (
            "/v1/completions",
            {"model": NAME, "prompt": {"text": "hi"}},
            422,
            "prompt",
            None,
            "must be a string, a list of token ids",
        ),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "max_tokens": 0},
            422,
            "max_tokens",
            None,
            ">= 1|equal to 1",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": 3}, 422, "temperature", None, "2"),
        ("/v1/completions", {"model": NAME}, 422, "prompt", None, "prompt is required"),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "hi", "best_of_all": 1},
            422,
            "best_of_all",
            None,
            "unknown field",
        ),
        ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 422, "messages", None, "valid (list|array)"),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": [{"role": "user", "content": 5}]},
            422,
            "messages[0].content",
            None,
            "a string or a list of",
        ),
        ("/v1/chat/completions", {"model": NAME, "messages": []}, 422, "messages", None, "at least 1"),
        ("/v1/completions", [1, 2], 422, None, None, "must be a JSON object, got list"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param, code, message):
    import re

    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert re.search(message, error["message"]), error["message"]


def test_a_prompt_that_fills_the_cache_or_passes_it_is_answered_alike_by_the_server_and_generate(
    server, reference, served_export, capsys
):
    """A prompt of exactly the KV cache's capacity decodes one token (the last is never stored: no position reads it),
    a longer one is refused with the same message, through the server and through paradecode-generate."""
    from paradecode.runtime.cli import main as generate_main

    capacity = reference.capacity
    ids = (reference.prompt_ids(LONG) * 2)[: capacity + 1]
    full = server.post("/v1/completions", {"model": NAME, "prompt": ids[:capacity]})
    assert full.status_code == 200, full.text
    answer = full.json()
    assert answer["usage"] == {"prompt_tokens": capacity, "completion_tokens": 1, "total_tokens": capacity + 1}
    assert answer["choices"][0]["finish_reason"] == "length"
    alone = reference.generate(prompt_ids=ids[:capacity], max_new_tokens=8)
    assert len(alone.token_ids) == 1 and alone.stats.stop_reason == "max_seq_len"
    assert generate_main([str(served_export), "--prompt-ids", ",".join(map(str, ids[:capacity]))]) == 0
    more = server.post("/v1/completions", {"model": NAME, "prompt": ids[:capacity], "max_tokens": 2})
    assert more.status_code == 400 and more.json()["error"]["param"] == "max_tokens"
    assert "so at most 1 new tokens" in more.json()["error"]["message"]

    past = server.post("/v1/completions", {"model": NAME, "prompt": ids})
    assert past.status_code == 413 and past.json()["error"]["code"] == "context_length_exceeded"
    message = past.json()["error"]["message"]
    assert message.startswith(f"the prompt has {capacity + 1} tokens, more than the export's KV cache holds")
    capsys.readouterr()
    assert generate_main([str(served_export), "--prompt-ids", ",".join(map(str, ids))]) == 2
    assert message in capsys.readouterr().err


def test_more_bad_requests(server, served_export, serve, tmp_path):
    big = server.post("/v1/completions", b"{" + b" " * (4 << 20) + b"}")
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    empty = server.post("/v1/completions", b"")
    assert empty.status_code == 400 and "no body" in empty.json()["error"]["message"]
    wrong_method = server.http.get("/v1/completions")
    assert wrong_method.status_code == 405 and "Method Not Allowed" in wrong_method.json()["error"]["message"]
    unknown = server.http.get("/v2/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as err:
        server.openai().chat.completions.create(model="other", messages=CHAT)
    assert err.value.code == "model_not_found"
    # A chat on an export without a chat template: 400, saying so; completions still work there.
    plain = serve(without_template(served_export, tmp_path / "plain"), replicas=1)
    refused = plain.post("/v1/chat/completions", {"model": NAME, "messages": CHAT})
    assert refused.status_code == 400 and "this export has no chat template" in refused.json()["error"]["message"]
    assert plain.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ messages[3].content }}", "UndefinedError"),
        ("{{ bos_tokn }}", "rendered nothing"),
        ("{{ 10**5000 }}", "more than 4096 bits"),
        ("{% for m in messages %}{{ m.content | center(10**9) }}{% endfor %}", "the filter center got the integer"),
    ],
)
def test_a_broken_chat_template_is_a_server_error_naming_the_export(serve, served_export, tmp_path, template, message):
    """500 server_error naming the export, not a 400 that blames the request; plain completions still work."""
    folder = with_file(served_export, tmp_path / "broken", "tokenizer/chat_template.jinja", template.encode())
    running = serve(folder, replicas=1)
    refused = running.post("/v1/chat/completions", {"model": NAME, "messages": CHAT})
    error = refused.json()["error"]
    assert refused.status_code == 500 and error["type"] == "server_error", refused.text
    assert "the served export is broken" in error["message"] and message in error["message"]
    assert running.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_template_refused_at_load_stops_the_server_with_exit_2(served_export, tmp_path, capsys):
    from paradecode.runtime.serve import cli

    folder = with_file(served_export, tmp_path / "include", "tokenizer/chat_template.jinja", b"{% include 'x' %}")
    assert cli.main([str(folder), "--port", "0", "--log-level", "error"]) == 2
    assert "uses {% include %} (line 1)" in capsys.readouterr().err


def test_a_bad_request_among_good_concurrent_ones(serve, served_export, reference, monkeypatch):
    running = serve(served_export, max_batch=1, replicas=2, max_queue=8)
    for model in running.pool.models:  # slow enough that the bad requests land while the good ones decode
        SlowStreams(model, monkeypatch, delay=0.01, count=10)
    want = expected(reference, 30, prompt=PROMPT).text
    bad = [
        {"model": NAME, "prompt": "hi", "max_tokens": "x"},
        {"model": "nope", "prompt": "hi"},
        {"model": NAME, "prompt": LONG},
        b"{not json",
    ]

    def good(_):
        lines = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 30, "stream": True})
        events = sse_events(lines.text.splitlines())
        return events[-1], "".join(e["choices"][0]["text"] for e in events[:-1])

    with ThreadPoolExecutor(4) as executor:
        goods = [executor.submit(good, i) for i in range(4)]
        wait_until(lambda: running.pool.counts()[1] == 2, what="two requests decoding")
        statuses = [running.post("/v1/completions", body).status_code for body in bad]
        results = [future.result(timeout=60) for future in goods]
    assert statuses == [422, 404, 413, 400]
    assert results == [("[DONE]", want)] * 4
    assert running.metrics()[("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "success")))] == 4


# --- queue, timeouts, disconnects -----------------------------------------------------------------------------------


def start_stream(running: Server, max_tokens: int = LONG_RUN) -> httpx.Response:
    """A streamed completion whose first chunk has arrived (the replica is decoding it)."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = running.http.build_request("POST", "/v1/completions", json=body)
    response = running.http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return response


def test_429_with_retry_after_when_the_queue_is_full(serve, served_export, monkeypatch):
    running = serve(served_export, max_batch=1, replicas=1, max_queue=1, retry_after=3)
    slow = SlowStreams(running.pool.models[0], monkeypatch, delay=0.25)  # busy for 12 s unless cancelled
    first = start_stream(running)
    with ThreadPoolExecutor(1) as executor:
        queued = executor.submit(running.post, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 4})
        wait_until(lambda: running.pool.counts() == (1, 1), what="one request decoding and one waiting")
        depth = running.metrics()
        assert depth[("paradecode_requests_waiting", ())] == 1 and depth[("paradecode_requests_running", ())] == 1
        full = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT})
        assert full.status_code == 429 and full.headers["retry-after"] == "3"
        assert full.json()["error"]["code"] == "rate_limit_exceeded" and "--max-queue 1" in full.text
        with pytest.raises(openai.RateLimitError):
            running.openai().completions.create(model=NAME, prompt=PROMPT)
        first.close()  # the client leaves: the queued request gets the replica
        assert queued.result(timeout=30).status_code == 200
    assert slow.results[0].stats.stop_reason == "cancelled"
    rejected = running.metrics()[("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "rejected")))]
    assert rejected == 2


def test_timeout_whole_streamed_and_in_the_queue(serve, served_export, monkeypatch):
    running = serve(served_export, max_batch=1, replicas=1, max_queue=2, request_timeout=0.5)
    slow = SlowStreams(running.pool.models[0], monkeypatch, delay=0.1, count=3)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True}
    started = time.monotonic()
    whole = running.post("/v1/completions", body)
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout"
    assert time.monotonic() - started < 4  # the whole request would take 4.8 s
    # The cancelled request leaves the replica at its next step; a request sent before that would wait in the queue
    # (under load, past its own 0.5 s: the queue's 504, tested below), so the streamed one is sent once it is free.
    wait_until(lambda: running.pool.counts() == (0, 0), what="the replica freed after the whole request")
    # Streamed: the status was 200 already, so the timeout arrives as an error event, then [DONE].
    *_, error, done = sse_events(running.post("/v1/completions", {**body, "stream": True}).text.splitlines())
    assert error["error"]["code"] == "timeout" and done == "[DONE]"
    wait_until(lambda: running.pool.counts() == (0, 0), what="the replica freed after the streamed request")
    with pytest.raises(openai.APIError, match="did not finish within 0.5 s"):
        list(running.openai().completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG_RUN, stream=True))
    wait_until(lambda: running.pool.counts() == (0, 0), what="the replica freed")
    assert [r.stats.stop_reason for r in slow.results] == ["cancelled"] * 3
    assert all(r.stats.new_tokens < 20 for r in slow.results)
    # In the queue: the replica is busy until the waiting request's first token could not come in time.
    SlowStreams(running.pool.models[0], monkeypatch, delay=0.1, count=2, before_first=True)
    with ThreadPoolExecutor(1) as executor:
        busy = executor.submit(running.post, "/v1/completions", body)
        wait_until(lambda: running.pool.counts()[1] == 1, what="a request decoding")
        queued = running.post("/v1/completions", {**body, "stream": True})  # no token yet: a real 504
        assert queued.status_code == 504
        assert busy.result(timeout=30).status_code == 504
    timeouts = running.metrics()[("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "timeout")))]
    assert timeouts == 5


def test_a_client_leaving_frees_the_replica(serve, served_export, monkeypatch):
    """Streamed and whole: the stream is closed after the token being computed, and the next request is served."""
    running = serve(served_export, max_batch=1, replicas=1, max_queue=2)
    slow = SlowStreams(running.pool.models[0], monkeypatch, delay=0.1, count=2)  # LONG_RUN tokens would take 4.8 s
    start_stream(running).close()
    wait_until(lambda: running.pool.counts() == (0, 0), 2, "the replica freed after a streamed client left")

    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", running.port)) as raw:  # a whole response, abandoned
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: running.pool.counts() == (0, 1), what="the abandoned request decoding")
    wait_until(lambda: running.pool.counts() == (0, 0), 2, "the replica freed after a waiting client left")
    started = time.monotonic()
    served = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8})
    assert served.status_code == 200 and time.monotonic() - started < 2
    assert [r.stats.stop_reason for r in slow.results] == ["cancelled", "cancelled"]
    assert all(r.stats.new_tokens <= 3 for r in slow.results), [r.stats.new_tokens for r in slow.results]
    model = running.pool.models[0]
    assert not model._streams and running.pool.engines[0].size == 0
    cancelled = running.metrics()[
        ("paradecode_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    ]
    assert cancelled == 2


def test_closing_the_pool_ends_its_jobs(served_export, monkeypatch):
    """close(): the running job stops after its token, the waiting one fails with 503, later ones are refused."""
    from paradecode.runtime.engine import StreamedToken
    from paradecode.runtime.serve.errors import ServiceUnavailable
    from paradecode.runtime.serve.pool import Job, ReplicaPool
    from paradecode.runtime.stats import GenerationResult

    pool = ReplicaPool(config_of(served_export, max_batch=1, replicas=1, max_queue=1))
    SlowStreams(pool.models[0], monkeypatch, delay=0.2)
    config = replace(GENERATION, max_new_tokens=LONG_RUN, ignore_eos=True)
    request = pool.models[0].request(prompt_ids=[1, 2, 3], config=config)

    async def scenario():
        loop = asyncio.get_running_loop()
        running, waiting = Job(request, loop), Job(request, loop)
        pool.submit(running)
        pool.submit(waiting)
        assert isinstance(await running.events.get(), StreamedToken)
        await asyncio.to_thread(pool.close)
        await asyncio.sleep(0.1)  # the workers' last events, handed over with call_soon_threadsafe
        ends = [running.events.get_nowait() for _ in range(running.events.qsize())][-1], waiting.events.get_nowait()
        with pytest.raises(ServiceUnavailable, match="shutting down"):
            pool.submit(Job(request, loop))
        return ends

    last, failed = asyncio.run(scenario())
    assert isinstance(last, GenerationResult) and last.stats.stop_reason == "cancelled"
    assert last.stats.new_tokens <= 3
    assert isinstance(failed, ServiceUnavailable)
    assert pool.models[0].closed


# --- metrics ------------------------------------------------------------------------------------------------------


def test_metrics_count_what_was_served(serve, served_export):
    # lookup from single tokens too: the random model's outputs repeat, so lookup proposes and is accepted
    running = serve(served_export, replicas=1, generation=replace(GENERATION, lookup_min_ngram=1))
    client = running.openai()
    before = running.metrics()
    assert before[("paradecode_replicas", ())] == 1 and before[("paradecode_generation_tokens_total", ())] == 0
    assert before[("paradecode_early_exits_total", (("layer", "1"),))] == 0  # every exit layer, from the start
    assert before[("process_resident_memory_bytes", ())] > 0  # the process collector (Linux): the server's RSS
    keep_going = {"ignore_eos": True}
    answers = [
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, extra_body=keep_going),
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=7, extra_body=keep_going),
    ]
    *_, last, usage = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=keep_going,
    )
    assert running.post("/v1/completions", {"model": NAME, "prompt": 5}).status_code == 422
    stats = [a.paradecode for a in answers] + [last.paradecode]
    usages = [a.usage for a in answers] + [usage.usage]
    after = running.metrics()
    count = lambda endpoint, outcome: after[
        ("paradecode_requests_total", (("endpoint", endpoint), ("outcome", outcome)))
    ]
    assert (count("completions", "success"), count("chat", "success"), count("completions", "invalid")) == (2, 1, 1)
    assert after[("paradecode_generation_tokens_total", ())] == sum(u.completion_tokens for u in usages) == 22
    assert after[("paradecode_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
    assert after[("paradecode_time_to_first_token_seconds_count", ())] == 3
    assert after[("paradecode_time_per_output_token_seconds_count", ())] == 22 - 3
    assert after[("paradecode_request_queue_seconds_count", ())] == 3
    assert after[("paradecode_e2e_request_latency_seconds_count", ())] == 3
    for layer in ("1", "2", "3"):
        exits = sum(s["exits_per_layer"].get(layer, 0) for s in stats)
        accepted = sum(s["accepted_per_layer"].get(layer, 0) for s in stats)
        assert after[("paradecode_early_exits_total", (("layer", layer),))] == exits
        assert after[("paradecode_early_exits_accepted_total", (("layer", layer),))] == accepted
    for name in ("proposed", "accepted"):
        counted = after[(f"paradecode_lookup_{name}_tokens_total", ())]
        assert counted == sum(s[f"lookup_{name}"] for s in stats) > 0, (name, stats)
    assert after[("paradecode_rollbacks_total", ())] == sum(s["rollbacks"] for s in stats) > 0
    assert after[("paradecode_requests_waiting", ())] == 0 and after[("paradecode_requests_running", ())] == 0


# --- the request mapping and stop strings, without a server ---------------------------------------------------------


def test_every_mapped_field_is_a_generation_setting():
    from dataclasses import fields

    have = {f.name for f in fields(GenerationConfig)}
    assert all(target in have for target in CONFIG_FIELDS.values())
    assert {"temperature", "top_p", "top_k", "seed"} <= set(CONFIG_FIELDS)


def test_a_seeded_sampled_request_is_the_runtime_s_seeded_sample(server, reference):
    """temperature/top_p/top_k/seed reach the runtime (vLLM's top_k -1 is 'no limit'; OpenAI's seed may be
    negative): the server's text is model.generate's with the same settings, and the seed reproduces it."""
    settings = {"temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 11}
    want = reference.generate(PROMPT, config=GENERATION, max_new_tokens=12, ignore_eos=True, **settings)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **settings}
    first = server.post("/v1/completions", body).json()
    again = server.post("/v1/completions", body).json()
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == want.text
    negative = server.post("/v1/completions", {**body, "seed": -5, "top_k": -1}).json()
    want = reference.generate(
        PROMPT, config=GENERATION, max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=2**64 - 5
    )
    assert negative["choices"][0]["text"] == want.text


@pytest.mark.parametrize(
    ("pieces", "stops", "sent", "result", "stop"),
    [
        (["Hello", " wor", "ld!"], ("world",), ["Hello", " ", ""], "Hello ", "world"),
        (["ab", "c", "d"], ("cd", "x"), ["ab", "", ""], "ab", "cd"),
        (["a", "b", "c"], ("bd",), ["a", "", "bc"], "abc", None),
        (
            ["one two"],
            ("two", "one t"),
            [
                "",
            ],
            "",
            "one t",
        ),
        (["no stops here"], (), ["no stops here"], "no stops here", None),
    ],
)
def test_stop_text_never_sends_part_of_a_stop_string(pieces, stops, sent, result, stop):
    text = StopText(stops)
    released = [text.push(p) for p in pieces]
    released[-1] += text.finish()
    assert released == sent and "".join(released) == result and text.stop == stop


def test_serve_config_checks_its_fields(served_export):
    config = ServeConfig(served_export)
    assert config.served_model_name == served_export.name and config.replicas == 1 and config.max_queue == 16
    assert ServeConfig(served_export, port=0).port == 0  # any free port
    for bad in (
        dict(replicas=0),
        dict(max_queue=-1),
        dict(request_timeout=0),
        dict(port=70000),
        dict(lanes=True),
        dict(backend="tpu"),
        dict(served_model_name=" "),
        dict(generation={"mode": "ar"}),
    ):
        with pytest.raises(UserInputError):
            ServeConfig(served_export, **bad)
    cores = os.cpu_count() or 1
    streams = GenerationConfig(overlap="streams")
    assert ServeConfig(served_export, replicas=2, lanes=2, generation=streams).threads_per_call == max(1, cores // 4)
    # batched (a CPU's auto): only the calling thread computes, so a replica's calls get its share of every core
    assert ServeConfig(served_export, replicas=2, lanes=2).threads_per_call == max(1, cores // 2)


# --- paradecode-serve, in a subprocess ------------------------------------------------------------------------------

# paradecode-serve with tokens DELAY s apart (its first argument), so requests are in flight when SIGTERM comes.
SLOW_SERVER = """
import sys, time
from paradecode.runtime.serve import cli
from paradecode.runtime import engine as batching
real_step = batching.Engine.step
def slow_step(self, *args, **kwargs):
    time.sleep(float(sys.argv[1]))
    return real_step(self, *args, **kwargs)
batching.Engine.step = slow_step
sys.exit(cli.main(sys.argv[2:]))
"""


def start_cli(
    export: Path, log: Path, delay: float, *flags: str, sigint_ignored: bool = False
) -> tuple[subprocess.Popen, str]:
    """paradecode-serve with slow tokens in a subprocess, its output in `log`; (process, its URL) once it serves.
    `sigint_ignored`: it inherits SIGINT ignored, as a shell script's background job does."""
    port = free_port()
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SLOW_SERVER,
                str(delay),
                str(export),
                "--port",
                str(port),
                "--served-model-name",
                NAME,
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            preexec_fn=ignore,
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"paradecode-serve exited with {process.returncode}: {log.read_text()}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 60, "paradecode-serve's start")
    return process, url


def stream_lines(url: str, max_tokens: int, into: list) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            into.extend(response.iter_lines())
    except httpx.HTTPError as err:
        into.append(err)


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests(served_export, tmp_path):
    process, url = start_cli(served_export, tmp_path / "log", 0.05, "--shutdown-timeout", "20")
    try:
        lines: list = []
        reader = threading.Thread(target=stream_lines, args=(url, 30, lines))
        reader.start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 1, 10, "a request decoding")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(url), 5, "new connections refused")
        reader.join(30)
        process.wait(30)
    finally:
        process.kill()
    err = (tmp_path / "log").read_text()
    events = sse_events(line for line in lines if isinstance(line, str))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", lines[-3:]
    assert events[-2]["paradecode"]["stop_reason"] == "max_new_tokens"
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "stopped (received SIGTERM)" in err and "replicas closed" in err


@pytest.mark.slow
def test_sigint_stops_with_130_where_it_was_inherited_as_ignored(served_export, tmp_path):
    """uvicorn stops on SIGINT whatever the server inherited; the server said nothing and exited 0 where a shell's
    background job had SIGINT ignored. Now it stops as on Ctrl-C: "stopped", the replicas closed, 130."""
    process, _ = start_cli(served_export, tmp_path / "log", 0.0, sigint_ignored=True)
    try:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    finally:
        process.kill()
    err = (tmp_path / "log").read_text()
    assert process.returncode == 128 + signal.SIGINT, err
    assert "paradecode-serve: stopped" in err and "replicas closed" in err and "Traceback" not in err, err


def whole_request(url: str, into: list) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True}
    try:
        into.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
    except httpx.HTTPError as err:
        into.append(err)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("signals", "code"),
    [((signal.SIGTERM,), 143), ((signal.SIGINT,), 130), ((signal.SIGINT, signal.SIGINT), 130)],
    ids=["SIGTERM", "SIGINT", "double Ctrl-C"],
)
def test_shutdown_answers_what_outlasts_the_shutdown_timeout(served_export, tmp_path, signals, code):
    """A running stream gets an error event and [DONE], a running and a queued whole request get 503 JSON, as
    docs/serving.md promises, and the log holds no traceback (uvicorn alone sent a plain 500 and cut the stream)."""
    flags = ("--shutdown-timeout", "0.5", "--replicas", "2", "--max-batch", "1")  # one running request per replica
    process, url = start_cli(served_export, tmp_path / "log", 0.5, *flags)
    try:
        lines: list = []
        answers: list = []
        clients = [threading.Thread(target=stream_lines, args=(url, LONG_RUN, lines))]  # 24 s of tokens each
        clients += [threading.Thread(target=whole_request, args=(url, answers)) for _ in range(2)]
        clients[0].start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 1, 10, "the stream decoding")
        for client in clients[1:]:
            client.start()
        wait_until(lambda: httpx.get(f"{url}/health").json()["waiting"] == 1, 10, "a whole request queued")
        started = time.monotonic()
        for i, signum in enumerate(signals):
            if i:
                time.sleep(0.2)
            process.send_signal(signum)
        process.wait(30)
        stopped = time.monotonic() - started
        for client in clients:
            client.join(30)
    finally:
        process.kill()
    err = (tmp_path / "log").read_text()
    assert process.returncode == code, err
    assert stopped < 12, f"took {stopped:.1f} s to stop:\n{err}"  # the requests alone would take 24 s
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err
    events = sse_events(line for line in lines if isinstance(line, str))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", lines[-3:]
    assert [a.status_code for a in answers] == [503, 503], answers
    assert all(a.json()["error"]["code"] == "shutting_down" for a in answers)
    assert "replicas closed" in err


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_cli_help_and_bad_input(tmp_path, capsys, served_export):
    from paradecode.runtime.serve import cli

    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main([str(served_export), "--port", str(taken.getsockname()[1]), "--log-level", "error"]) == 2
    assert "is taken (Address already in use): choose another --port" in capsys.readouterr().err
    for host, message in (("no-such-host.invalid", "this machine can resolve"), ("192.0.2.1", "not an address of")):
        assert cli.main([str(served_export), "--host", host, "--log-level", "error"]) == 2
        err = capsys.readouterr().err
        assert f"--host {host!r}" in err and message in err and "--port" not in err, err

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0 and "--max-queue" in capsys.readouterr().out
    assert cli.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main([str(tmp_path), "--num-gpus", "1"]) == 2
    assert "--num-gpus need --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path), "--replicas", "0"])
    assert shutil.which("paradecode-serve", path=str(Path(sys.executable).parent)), "the console script is installed"


def test_the_server_loads_an_export_with_the_runtime_alone():
    """runtime/serve imports runtime and graphs only: never transformers, the exporter or the tools."""
    code = (
        "import sys\n"
        "import paradecode.runtime.serve.cli, paradecode.runtime.serve.app, paradecode.runtime.serve.ray_serve\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m.startswith(('paradecode.export',"
        " 'paradecode.tools')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"
    light = "import sys, paradecode.runtime.serve; print(sorted({'fastapi', 'uvicorn', 'ray'} & set(sys.modules)))"
    assert (
        subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
