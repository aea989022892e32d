"""paradecode-serve under the cases a probe of careless and hostile clients found (issue 19): slow and vanishing
clients, floods of huge prompts, a served export changed on disk, shutdown, its HTTP surface, and its CLI's start.

Every wait is bounded; raw sockets go to 127.0.0.1 only. The export is `served_export` (tests/runtime/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from paradecode.graphs.errors import ExportChangedError, ManifestError, UserInputError
from tests.conftest import REPO
from tests.runtime.serve.test_serve import PROMPT, start_cli
from tests.runtime.test_chat import with_file
from tests.serving import NAME, Server, SlowStreams, config_of, sse_events, wait_until

pytestmark = pytest.mark.timeout(120)

LONG_RUN = 48


def raw_connection(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `sock`, or None if it was still open after `seconds`."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def head(body_length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {body_length}\r\n\r\n".encode()
    )


def counted(running, endpoint: str, outcome: str) -> float:
    return running.metrics()[("paradecode_requests_total", (("endpoint", endpoint), ("outcome", outcome)))]


# --- the HTTP surface -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/docs", {}, 404),
        ("GET", "/redoc", {}, 404),
        ("GET", "/openapi.json", {}, 404),
        ("GET", "/v1/models/", {"Host": "evil.example"}, 404),  # no redirect built from the client's Host
        ("POST", "/v1/completions/", {"Host": "evil.example"}, 404),
        ("HEAD", "/health", {}, 200),
        ("GET", "/health", {}, 200),
    ],
)
def test_http_surface(serve, served_export, method, path, headers, status):
    running = serve(served_export, replicas=1)
    response = running.http.request(method, path, headers=headers)
    assert response.status_code == status, response.text
    assert "location" not in response.headers and "evil.example" not in response.text
    if method == "HEAD":
        assert response.content == b""
    elif status == 404:
        assert response.json()["error"]["type"] == "invalid_request_error"


def big_head(fields: int, value_bytes: int) -> bytes:
    lines = b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * value_bytes) for i in range(fields))
    return b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (big_head(1, 100_000), 431, "request_header_fields_too_large"),  # one read over loopback: h11 let it pass
        (big_head(1_000, 1), 431, "request_header_fields_too_large"),  # 14 KB, but 1,000 fields
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, "malformed_request"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
            "malformed_request",
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed_request"),
    ],
    ids=["100 KB head", "1000 fields", "Content-Length -1", "bad chunk size", "bad request line"],
)
def test_oversized_heads_and_bad_framing_get_openai_json_errors(serve, served_export, request_bytes, status, code):
    """The head is bounded as protocol.py says (16 KiB, 100 fields) and h11's framing errors are answered with
    OpenAI's error object, not uvicorn's plain-text 400; the server serves on."""
    running = serve(served_export, replicas=1)
    answer = closed_within(raw_connection(running.port, request_bytes), 5)
    assert answer is not None, "the connection was not closed"
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    assert b"content-type: application/json" in head_part.lower(), head_part
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    if status == 431:
        assert "16384 bytes and 100 fields" in error["message"], error
    assert running.http.get("/health").status_code == 200


def test_an_oversized_head_request_gets_its_431_without_a_body(serve, served_export):
    running = serve(served_export, replicas=1)
    answer = closed_within(raw_connection(running.port, big_head(1_000, 1).replace(b"GET ", b"HEAD ", 1)), 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 431 "), answer[:300]
    assert answer.endswith(b"\r\n\r\n") and b"content-length: " in answer.lower(), answer


def test_a_head_within_the_bounds_is_served(serve, served_export):
    running = serve(served_export, replicas=1)
    answer = closed_within(raw_connection(running.port, big_head(90, 150)[:-2] + b"Connection: close\r\n\r\n"), 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# --- slow and vanishing clients -------------------------------------------------------------------------------------


def test_half_sent_heads_and_bodies_are_closed_within_the_read_timeout(serve, served_export):
    """A client that sends part of its request head, or of its body, and stops is disconnected after
    --read-timeout (the body with a 408 first); meanwhile other clients are served at once."""
    running = serve(served_export, replicas=1, read_timeout=1.0)
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2}).encode()
    heads = [raw_connection(running.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-") for _ in range(20)]
    idle = [raw_connection(running.port, b"") for _ in range(10)]
    bodies = [raw_connection(running.port, head(len(body)) + body[:10]) for _ in range(20)]
    started = time.monotonic()
    served = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2})
    assert served.status_code == 200 and time.monotonic() - started < 1
    for sock in heads + idle:
        assert closed_within(sock, 4) == b"", "a half-sent head was not closed"
    for sock in bodies:
        answer = closed_within(sock, 4)
        assert answer is not None, "a half-sent body was not closed"
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in answer, answer[:200]
    assert time.monotonic() - started < 6
    assert counted(running, "completions", "timeout") == 20
    for sock in heads + idle + bodies:
        sock.close()


def test_the_request_timeout_covers_reading_and_preparing(serve, served_export, monkeypatch):
    running = serve(served_export, replicas=1, request_timeout=1.0, read_timeout=30.0)
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2}).encode()
    started = time.monotonic()
    trickle = raw_connection(running.port, head(len(body)) + body[:5])
    answer = closed_within(trickle, 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
    assert time.monotonic() - started < 3
    real = running.service.prepare

    def slow_prepare(request):
        time.sleep(3)
        return real(request)

    monkeypatch.setattr(running.service, "prepare", slow_prepare)
    started = time.monotonic()
    slow = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2})
    assert slow.status_code == 504 and "tokenizing the prompt included" in slow.json()["error"]["message"]
    assert time.monotonic() - started < 2.5


def test_a_client_leaving_mid_upload_is_cancelled_without_a_traceback(serve, served_export, caplog):
    running = serve(served_export, replicas=1)
    for _ in range(5):
        sock = raw_connection(running.port, head(1000) + b'{"model": ')
        time.sleep(0.05)
        sock.close()
    wait_until(lambda: counted(running, "completions", "cancelled") == 5, 5, "five cancelled uploads")
    assert counted(running, "completions", "error") == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info], caplog.text
    assert "the client left (it left while sending its body" in caplog.text


# --- floods of huge prompts -----------------------------------------------------------------------------------------


def test_a_flood_of_huge_prompts_is_refused_before_tokenizing_and_stalls_nobody(serve, served_export, monkeypatch):
    # room for every body of the flood: here each gets its 413 by the prompt's bytes (the bound on the bodies waiting
    # to be prepared, which would refuse most of them with 429, has a test of its own below)
    running = serve(served_export, replicas=1, max_preparing_bytes=64 << 20)
    tokenizer = running.pool.models[0].tokenizer
    lengths = []
    real_encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, *a, **k: lengths.append(len(text)) or real_encode(text, *a, **k)
    )
    huge = {"model": NAME, "prompt": "Once upon a time " * 240_000}  # 4.08 MB of text, just under the body limit
    chat = {"model": NAME, "messages": [{"role": "user", "content": huge["prompt"]}]}
    rss_before = running.metrics()[("process_resident_memory_bytes", ())]

    def flood(i):
        path, body = ("/v1/chat/completions", chat) if i % 2 else ("/v1/completions", huge)
        return running.post(path, body)

    with ThreadPoolExecutor(12) as executor:
        answers = [executor.submit(flood, i) for i in range(12)]
        time.sleep(0.2)
        started = time.monotonic()
        tiny = running.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2})
        tiny_seconds = time.monotonic() - started
        health_seconds = time.monotonic()
        assert running.http.get("/health").status_code == 200
        health_seconds = time.monotonic() - health_seconds
        statuses = [(a.result(timeout=60).status_code, a.result().json()["error"]["code"]) for a in answers]
    assert statuses == [(413, "context_length_exceeded")] * 12
    assert tiny.status_code == 200 and tiny_seconds < 2 and health_seconds < 1, (tiny_seconds, health_seconds)
    assert max(lengths) <= running.service.max_prompt_bytes, "a huge prompt reached the tokenizer"
    rss_after = running.metrics()[("process_resident_memory_bytes", ())]
    assert rss_after - rss_before < 200e6, f"RSS grew {(rss_after - rss_before) / 1e6:.0f} MB"
    message = flood(0).json()["error"]["message"]
    assert "bytes of text" in message and "--max-seq-len" in message


@pytest.mark.timeout(60)
def test_bodies_past_the_preparing_bound_get_429_and_stall_nobody(serve, served_export, monkeypatch):
    """Large bodies, each under --max-body-bytes, that together hold --max-preparing-bytes: the next large one gets 429
    with Retry-After at once, /health answers at once, and a small request is prepared on the thread kept for small
    ones while the large ones hold theirs."""
    running = serve(served_export, replicas=1, max_body_bytes=200_000, max_preparing_bytes=400_000, retry_after=2)
    release = threading.Event()
    real = running.service._parse_and_prepare

    def held(kind, body):  # a large prompt's tokenizing, for as long as the test wants
        if len(body) > 100_000:
            release.wait(30)
        return real(kind, body)

    monkeypatch.setattr(running.service, "_parse_and_prepare", held)
    large = {"model": NAME, "prompt": "Once upon a time " * 9_000}  # 153 KB: two fit in the bound, three do not
    seconds = {}

    def timed(name, send):
        started = time.monotonic()
        response = send()
        seconds[name] = time.monotonic() - started
        return response

    try:
        with ThreadPoolExecutor(2) as executor:
            flood = [executor.submit(running.post, "/v1/completions", large) for _ in range(2)]
            wait_until(lambda: running.service.preparer.waiting_bytes > 300_000, 10, "two large bodies admitted")
            refused = timed("refused", lambda: running.post("/v1/completions", large))
            health = timed("health", lambda: running.http.get("/health"))
            small = timed("small", lambda: running.post("/v1/completions", {"model": NAME, "prompt": PROMPT}))
            release.set()
            answers = [future.result(timeout=30) for future in flood]
    finally:
        release.set()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2", refused.text
    error = refused.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded", error
    assert "--max-preparing-bytes 400,000" in error["message"] and "retry after 2 s" in error["message"]
    assert health.status_code == 200 and small.status_code == 200, (health.text, small.text)
    assert max(seconds.values()) < 2, seconds
    assert [a.json()["error"]["code"] for a in answers] == ["context_length_exceeded"] * 2  # prepared once released
    assert running.service.preparer.waiting_bytes == 0
    assert counted(running, "completions", "rejected") == 1


@pytest.mark.timeout(30)
def test_the_preparer_takes_the_smallest_body_first_and_forgets_one_that_gave_up():
    from paradecode.runtime.serve.errors import QueueFull
    from paradecode.runtime.serve.preparing import Preparer

    async def scenario():
        preparer = Preparer(threads=1, max_bytes=10_000, retry_after=1)
        gate, order = threading.Event(), []
        run = lambda size: asyncio.create_task(preparer.run(size, lambda: order.append(size)))
        first = asyncio.create_task(preparer.run(100, lambda: gate.wait(10) and order.append(100)))  # the thread
        await asyncio.sleep(0.05)
        big, gone, small = run(5_000), run(3_000), run(200)
        await asyncio.sleep(0.05)
        assert preparer.waiting_bytes == 8_300
        gone.cancel()  # its request gave up while waiting: out of the queue, its bytes free
        await asyncio.sleep(0.05)
        assert preparer.waiting_bytes == 5_300
        with pytest.raises(QueueFull, match="hold 5,300 bytes, and this one's 5,000"):
            await preparer.run(5_000, lambda: None)
        gate.set()
        await asyncio.gather(first, big, small)
        assert order == [100, 200, 5_000] and preparer.waiting_bytes == 0
        preparer.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_health_answers_while_a_long_prompt_is_tokenized(serve, served_export, monkeypatch):
    """Tokenizing runs in a preparation thread and lets go of the GIL: the event loop (and this test's thread) run
    meanwhile. Timed from the tokenizer's start: while a thread holds the GIL, no other starts even its clock."""
    running = serve(served_export, replicas=1)
    monkeypatch.setattr(running.service, "max_prompt_bytes", 4 << 20)  # a long text reaches the tokenizer
    tokenizer = running.pool.models[0].tokenizer
    entered, spans = [], []
    real = tokenizer.encode

    def encode(text, *args, **kwargs):
        entered.append(time.monotonic())
        try:
            return real(text, *args, **kwargs)
        finally:
            spans.append(time.monotonic() - entered[-1])

    monkeypatch.setattr(tokenizer, "encode", encode)
    text = " ".join(f"w{i * 7919 % 100_003}x{i % 97}" for i in range(120_000))  # 1.5 MB, few repeated words
    with ThreadPoolExecutor(1) as executor:
        long = executor.submit(running.post, "/v1/completions", {"model": NAME, "prompt": text})
        wait_until(lambda: bool(entered), 20, "the long prompt reaching the tokenizer")
        health = running.http.get("/health")
        health_seconds = time.monotonic() - entered[0]
        answer = long.result(timeout=40)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert spans[0] > 0.5, f"tokenizing took {spans[0]:.2f} s: too short for this test to tell anything"
    assert health.status_code == 200 and health_seconds < spans[0] / 4, (health_seconds, spans)


# --- a served export changed on disk --------------------------------------------------------------------------------


def truncate(weights: Path) -> None:
    os.truncate(weights, weights.stat().st_size // 2)


def overwrite_in_place(weights: Path) -> None:
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\0" * 4096)
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later mtime even on a coarse clock


def replace_by_rename(weights: Path) -> None:
    shutil.copyfile(weights, weights.with_name("new"))
    os.replace(weights.with_name("new"), weights)  # another file with the same content: the same export


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("change", "status"), [(truncate, 503), (overwrite_in_place, 503), (replace_by_rename, 200)], ids=lambda v: str(v)
)
def test_changed_weights_get_503_not_sigbus(served_export, tmp_path, change, status):
    """In a subprocess: a SIGBUS would kill it (exit 135). A weights file written in place makes every request and
    /health answer 503 with a log line, and the server stays up; an identical copy renamed in keeps being served."""
    export = tmp_path / "export"
    shutil.copytree(served_export, export)
    process, url = start_cli(export, tmp_path / "log", 0.0)
    try:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        change(export / "onnx" / "weights.safetensors")
        for stream in (False, True):
            answer = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=30)
            assert answer.status_code == status, answer.text
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == status
        if status == 503:
            assert answer.json()["error"]["code"] == "export_changed" and health.json()["status"] == "export_changed"
        assert process.poll() is None, "the server died"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    log = (tmp_path / "log").read_text()
    assert process.returncode == 128 + signal.SIGTERM, log
    # the change logged once, when found; the requests and /health it refused not one line each
    changes = log.count("the loaded export's onnx/weights.safetensors changed on disk")
    assert changes == (1 if status == 503 else 0) and "refused a request" not in log, log


@pytest.mark.timeout(120)
def test_the_runtime_refuses_changed_weights(served_export, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(served_export, export)
    code = (
        "import os, sys\n"
        "from paradecode.runtime import load\n"
        "from paradecode.graphs.errors import ExportChangedError\n"
        f"model = load({str(export)!r})\n"
        "model.generate(prompt_ids=[1, 2], max_new_tokens=2)\n"
        "weights = model.export.file(model.manifest.weights)\n"
        "os.truncate(weights, 100)\n"
        "try:\n"
        "    model.generate(prompt_ids=[1, 2], max_new_tokens=2)\n"
        "except ExportChangedError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert done.returncode == 0, done.stderr  # 135 would be a SIGBUS
    assert "refused: the export's files changed on disk" in done.stdout and "-> 100 bytes" in done.stdout


# --- no path of the server's disk in a response ---------------------------------------------------------------------


def export_changed(running, export: Path, monkeypatch) -> list:
    """The replicas' check of their folder fails, as the runtime words it: every request and /health get 503."""

    def check():
        raise ExportChangedError(
            f"the export's files changed on disk while this model serves them ({export}/onnx/weights.safetensors: "
            "1800 -> 900 bytes)."
        )

    monkeypatch.setattr(running.service.reference.files, "check", check)  # the replicas' one opened export
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    return [
        ("/v1/completions", body, 503, "(onnx/weights.safetensors: 1800 -> 900 bytes)"),
        ("/v1/completions", {**body, "stream": True}, 503, "(onnx/weights.safetensors: 1800 -> 900 bytes)"),
        ("/health", None, 503, "(onnx/weights.safetensors: 1800 -> 900 bytes)"),
    ]


def broken_template(running, export: Path, monkeypatch) -> list:
    """The chat template fails while rendering: 500, naming the template's file."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    return [("/v1/chat/completions", body, 500, "tokenizer/chat_template.jinja failed while rendering a chat")]


def broken_while_decoding(running, export: Path, monkeypatch) -> list:
    """A replica's decoding fails after a request's first token (a file of the export going bad mid-way): 500, or an
    error event in a stream."""
    backend = running.pool.models[0].backend
    real, embeds = backend.run, []
    error = ManifestError(f"{export / 'onnx' / 'embed.onnx'} has 1942 bytes, the manifest records 1800.")

    def run(name, feeds, lane="main", outputs=None):
        if name == "embed":
            embeds.append(name)
            if len(embeds) % 2 == 0:  # each request's prefill embeds, then its first decoding step fails
                raise error
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(backend, "run", run)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    return [
        ("/v1/completions", body, 500, "onnx/embed.onnx has 1942 bytes"),
        ("/v1/completions", {**body, "stream": True}, 200, "onnx/embed.onnx has 1942 bytes"),
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case", [export_changed, broken_template, broken_while_decoding], ids=lambda case: case.__name__
)
def test_no_response_holds_the_exports_path(serve, served_export, tmp_path, monkeypatch, case):
    """500 and 503 bodies, streamed error events and /health's 503 name the export's files relative to it."""
    template = b"{{ messages[3].content }}" if case is broken_template else None
    export = tmp_path / "export"
    if template is None:
        shutil.copytree(served_export, export)
    else:
        with_file(served_export, export, "tokenizer/chat_template.jinja", template)
    running = serve(export, replicas=1, max_batch=1)
    for path, body, status, expected in case(running, export, monkeypatch):
        response = running.http.get(path) if body is None else running.post(path, body)
        assert response.status_code == status, response.text
        assert expected in response.text, response.text
        for hidden in {str(tmp_path), str(tmp_path.resolve()), str(export.resolve())}:
            assert hidden not in response.text, response.text


def test_a_larger_body_bound_alone_raises_the_preparing_bound_with_it(served_export):
    """`--max-body-bytes 16777216` alone started before the preparing bound existed; it still does (the bound follows
    it), and an explicit smaller --max-preparing-bytes is still refused."""
    from paradecode.runtime.serve import cli

    config, _ = cli.configs_of(cli.build_parser().parse_args([str(served_export), "--max-body-bytes", str(16 << 20)]))
    assert (config.max_body_bytes, config.max_preparing_bytes) == (16 << 20, 16 << 20)
    default, _ = cli.configs_of(cli.build_parser().parse_args([str(served_export)]))
    assert default.max_preparing_bytes == 8 << 20
    flags = [str(served_export), "--max-body-bytes", str(16 << 20), "--max-preparing-bytes", str(8 << 20)]
    with pytest.raises(UserInputError, match="max_preparing_bytes 8388608 is less than max_body_bytes"):
        cli.configs_of(cli.build_parser().parse_args(flags))


def test_public_text_hides_every_spelling_of_the_export(tmp_path, monkeypatch):
    """A relative spelling ("out/model", as given on the command line) too; "/" or "." as the export mangles
    nothing."""
    from paradecode.runtime.serve.errors import public_text

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "model" / "onnx").mkdir(parents=True)
    text = "out/model/onnx/weights.safetensors changed; see out/model"
    assert public_text(text, Path("out/model")) == "onnx/weights.safetensors changed; see model"
    assert public_text(f"{tmp_path}/out/model/onnx/x.onnx", Path("out/model")) == "onnx/x.onnx"
    assert public_text("/etc/a and ./b", Path("/")) == "/etc/a and ./b"
    assert public_text("onnx/a.onnx", Path(".")).endswith("onnx/a.onnx")


# --- shutdown, in process -------------------------------------------------------------------------------------------


def test_closing_answers_a_stream_and_a_queued_request(served_export, monkeypatch):
    """Server.close() shuts down as SIGTERM does: after shutdown_timeout the running stream gets an error event and
    [DONE], the queued whole request 503 JSON (the slow tests do the same with signals, in a subprocess)."""
    running = Server(config_of(served_export, max_batch=1, replicas=1, shutdown_timeout=0.5))
    SlowStreams(running.pool.models[0], monkeypatch, delay=0.2)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True}
    lines: list = []

    def stream():
        with httpx.stream("POST", f"{running.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines.extend(r.iter_lines())

    with ThreadPoolExecutor(2) as executor:
        streamed = executor.submit(stream)
        wait_until(lambda: running.pool.counts() == (0, 1), what="the stream decoding")
        queued = executor.submit(httpx.post, f"{running.url}/v1/completions", json=body, timeout=30)
        wait_until(lambda: running.pool.counts() == (1, 1), what="a request queued")
        started = time.monotonic()
        running.close()
        streamed.result(timeout=30)
        answer = queued.result(timeout=30)
    assert time.monotonic() - started < 5
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"


# --- the command line's start ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_port_0_listens_on_a_free_port_and_says_which(served_export, tmp_path):
    log = tmp_path / "log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "paradecode.runtime.serve.cli", str(served_export), "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        wait_until(lambda: "serving " in log.read_text() or process.poll() is not None, 60, "the server's start")
        port = int(re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", log.read_text()).group(1))
        assert port != 0
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200, 30, "health")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 128 + signal.SIGTERM


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_the_server_starts_serving_stops_it_cleanly(served_export, sig):
    """The signal sent the moment the server says it serves, before uvicorn has taken the signals (the full suite on a
    loaded 2-core machine once hit this window: "stopped", then asyncio's "Task was destroyed but it is pending!"):
    it stops with 128 + the signal and nothing after its last line, every time."""
    code = f"import sys\nfrom paradecode.runtime.serve.cli import main\nsys.exit(main([{str(served_export)!r}]))\n"
    for _ in range(3):
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            lines = []
            while not (line := process.stderr.readline()).count(" serving ") and line:
                lines.append(line)
            assert line, "".join(lines)
            process.send_signal(sig)
            _, err = process.communicate(timeout=60)
        finally:
            process.kill()
        assert process.returncode == 128 + sig, err
        assert re.search(r"\nparadecode-serve: stopped( \(received SIGTERM\))?$", err.strip()), err
        assert "Task was destroyed" not in err and "never awaited" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ctrl_c_as_uvicorn_starts_its_loop_stops_the_server_cleanly(served_export):
    """The window the suite once hit, made certain: SIGINT inside uvicorn's `asyncio_run`, its server's coroutine made
    and not yet awaited (before: a KeyboardInterrupt there, and asyncio's "never awaited" after "stopped")."""
    code = (
        "import os, signal, sys, time\n"
        "import uvicorn.server\n"
        "started = uvicorn.server.asyncio_run\n"
        "def asyncio_run(main, **settings):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    return started(main, **settings)\n"
        "uvicorn.server.asyncio_run = asyncio_run\n"
        "from paradecode.runtime.serve.cli import main\n"
        f"sys.exit(main([{str(served_export)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=100)
    assert out.returncode == 130 and out.stderr.strip().endswith("paradecode-serve: stopped"), out.stderr
    assert "never awaited" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_command_lines_import_no_torch():
    """What a console script imports before main() runs, when a Ctrl-C would print a traceback: a few ms, not torch."""
    code = (
        "import sys, paradecode.runtime.serve.cli, paradecode.runtime.cli\n"
        "print(sorted({'torch', 'numpy', 'onnxruntime', 'fastapi'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("module", ["paradecode.runtime.serve.cli", "paradecode.runtime.cli"])
@pytest.mark.parametrize("delay", [0.1, 0.3, 0.8])
def test_ctrl_c_in_the_first_second_prints_no_traceback(served_export, module, delay):
    generate = module == "paradecode.runtime.cli"
    args = [str(served_export)] + (["--prompt", "hi", "--max-new-tokens", "64"] if generate else [])
    code = f"import sys\nfrom {module} import main\nprint('ready', flush=True)\nsys.exit(main({args!r}))\n"
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    finished = generate and "stopped by" in err  # generate may finish first: its summary line is printed
    if process.returncode == 0 or (finished and process.returncode == -signal.SIGINT):
        # nothing to interrupt, or the interrupt landed as the interpreter exited after main() returned
        assert generate and finished and "Traceback" not in err, err
        return
    assert process.returncode == 130 and "Traceback" not in err, err
    assert re.search(r": (stopped|interrupted)$", err.strip()), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("template", "message"),
    [
        (  # 660 KB of folded constants
            "{% if false %}" + "{{ 1 + 2 }}" * 60_000 + "{% endif %}",
            "chat_template.jinja is refused before compiling: the template has more than 50,000 tokens",
        ),
        ("{# #}" + " " * (1 << 20), "chat_template.jinja has 1,048,581 bytes, more than the 1 MiB allowed for it"),
    ],
    ids=["tokens", "bytes"],
)
def test_a_huge_chat_template_stops_the_server_at_once_with_exit_2(served_export, tmp_path, template, message):
    """Refused before the work that grows with it (86 s and 2.9 GB for 4 MB of folded constants), with a message."""
    folder = with_file(served_export, tmp_path / "huge", "tokenizer/chat_template.jinja", template.encode())
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "paradecode.runtime.serve.cli", str(folder), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        _, err = process.communicate(timeout=40)
    finally:
        process.kill()
    assert process.returncode == 2, err
    assert "paradecode-serve: error: " in err and message in err and "Traceback" not in err, err
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "source"),
    [
        ((), "(the export's limits.max_batch; --max-batch serves fewer)"),
        (("--max-batch", "999999999"), "(--max-batch)"),
    ],
    ids=["the export's", "--max-batch"],
)
def test_a_batch_the_memory_cannot_hold_is_refused_before_allocating(served_export, tmp_path, capsys, flags, source):
    from paradecode.runtime.serve import cli

    export = tmp_path / "export"
    shutil.copytree(served_export, export)
    manifest = json.loads((export / "manifest.json").read_text())
    manifest["limits"]["max_batch"] = 1_000_000_000  # KV-cache rows of 48 KiB each: 46 TiB, more than any machine's
    (export / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main([str(export), "--port", "0", "--log-level", "error", *flags]) == 2
    err = capsys.readouterr().err
    assert f"requests together {source} need " in err, err
    assert re.search(r"need [\d.]+ GiB \([\d,]+ bytes\) of KV cache", err), err
    assert re.search(r"memory has [\d.]+ [GMK]iB \([\d,]+ bytes\) available: serve with --max-batch \d+ or less", err)


def test_a_batch_that_fits_says_what_it_reserves(served_export):
    """What a server's batches may take, logged at start: the KV cache's bytes per row at max_seq_len times rows and
    replicas, and when they are taken."""
    from paradecode.runtime import load
    from paradecode.runtime.serve.memory import check_batches_fit, row_bytes, size

    with load(served_export) as model:
        said = check_batches_fit(model, 3, 2, given=True)
        per_row = row_bytes(model)
    assert per_row > 0
    assert said.startswith(f"KV cache of 2 replica(s) x 3 rows: at most {size(6 * per_row)} ({size(per_row)} a row")
    assert "given back when a replica has none left" in said and "memory available: " in said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["not_a_host..x", "a" * 64 + ".example", ".."])
def test_a_host_that_is_not_a_host_name_exits_2(served_export, capsys, host):
    from paradecode.runtime.serve import cli

    assert cli.main([str(served_export), "--host", host, "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert f"--host {host!r} is not an address or a host name" in err and "not a valid host name" in err, err
