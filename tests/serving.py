"""Helpers for the server's tests: a real uvicorn server on a free localhost port, slowed replicas, SSE reading.

Every request goes to 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.serve.config import ServeConfig

NAME = "tiny-chat"  # the served model's name in the server tests
SEQ_LEN = 64  # the served export's max_seq_len
GENERATION = GenerationConfig(thresholds=0.0)  # every token exits early: exits and rollbacks in every response


def config_of(export: Path, **fields) -> ServeConfig:
    """The tests' ServeConfig: NAME, GENERATION and a 5 s shutdown unless `fields` say otherwise."""
    return ServeConfig(export, **{"served_model_name": NAME, "generation": GENERATION, "shutdown_timeout": 5, **fields})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], bool], seconds: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {seconds:g} s")
        time.sleep(0.01)


class Server:
    """A `Service` behind paradecode-serve's uvicorn server in a background thread, on a free port of 127.0.0.1.

    `close()` shuts it down as SIGTERM does: in-flight requests get the config's shutdown_timeout.
    """

    def __init__(self, config: ServeConfig):
        from paradecode.runtime.serve.cli import http_server
        from paradecode.runtime.serve.protocol import listening_socket
        from paradecode.runtime.serve.service import Service

        self.config = config
        self.service = Service(config)
        self.sock = listening_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = http_server(self.service)  # paradecode-serve's: its protocol, app and shutdown
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the server's start")
        self.http = httpx.Client(base_url=self.url, timeout=60)

    @property
    def pool(self):
        return self.service.pool

    def openai(self, **options):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **options)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.http.post(path, content=content, headers={"content-type": "application/json"}, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        response = self.http.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)
        self.service.close()
        self.sock.close()


def sse_events(lines) -> list:
    """The `data:` payloads of a Server-Sent Events body, JSON-decoded ("[DONE]" kept as is)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


class SlowSteps:
    """Makes every batch step wait `delay` s first (a slow device, for batching replicas): requests stay in their
    batch long enough for a test to join, cancel or disconnect them mid-batch."""

    def __init__(self, monkeypatch, delay: float):
        from paradecode.runtime import engine as batching

        real = batching.Engine.step

        def step(batch, *args, **kwargs):
            time.sleep(delay)
            return real(batch, *args, **kwargs)

        monkeypatch.setattr(batching.Engine, "step", step)


class SlowStreams:
    """Makes the next `count` requests a replica's model decodes wait `delay` s before each token after the first (a
    slow device), and before the first too with `before_first`: every step of an engine holding one of them waits.

    `results` collects each slowed request's GenerationResult as it ends, so a test can see how far it went and why
    it stopped.
    """

    def __init__(self, model, monkeypatch, delay: float, count: int = 1, before_first: bool = False):
        from paradecode.runtime import engine as engine_module
        from paradecode.runtime.stats import GenerationResult

        self.delay = delay
        self.left = count
        self.results = []
        slowed = set()  # the slowed sequences
        join, step = engine_module.Engine.join, engine_module.Engine.step

        def slow_join(engine, sequence):
            if engine.runtime is model.runtime and self.left > 0:
                self.left -= 1
                slowed.add(sequence)
                sink = sequence.sink

                def recording(event):
                    if isinstance(event, GenerationResult):
                        self.results.append(event)
                    sink(event)

                sequence.sink = recording
                if before_first:
                    time.sleep(delay)
            return join(engine, sequence)

        def slow_step(engine, *args, **kwargs):
            if engine.runtime is model.runtime and any(s in slowed for s in engine.sequences):
                time.sleep(delay)
            return step(engine, *args, **kwargs)

        monkeypatch.setattr(engine_module.Engine, "join", slow_join)
        monkeypatch.setattr(engine_module.Engine, "step", slow_step)
