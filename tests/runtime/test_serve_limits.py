"""paradecode-serve under the cases a probe of careless and hostile clients found (issue 19): slow and vanishing
clients, floods of huge prompts, a served export changed on disk, shutdown, its HTTP surface, and its CLI's start.

Every wait is bounded; raw sockets go to 127.0.0.1 only. The export is `served_export` (tests/runtime/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.runtime.test_serve import PROMPT, start_cli
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
    running = serve(served_export, replicas=1)
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
    os.replace(weights.with_name("new"), weights)  # what re-exporting with --force does: the old file stays mapped


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("change", "status"), [(truncate, 503), (overwrite_in_place, 503), (replace_by_rename, 200)], ids=lambda v: str(v)
)
def test_changed_weights_get_503_not_sigbus(served_export, tmp_path, change, status):
    """In a subprocess: a SIGBUS would kill it (exit 135). A weights file written in place makes every request and
    /health answer 503 with a log line, and the server stays up; a file replaced by a rename keeps being served."""
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
    assert ("refused a request: the export's files changed on disk" in log) == (status == 503), log


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
