"""`paradecode-serve` in a subprocess, for tools that measure it from outside: start, wait for /health, stop.

`ServerProcess` follows one lifecycle, as a context manager: `__enter__` starts the server on a free
(or the given) port of 127.0.0.1 and returns once `/health` answers 200 (or raises `ServerFailed` with the tail of
the server's output if it exits or does not answer in time); `__exit__` sends SIGTERM, waits for the
server to finish its in-flight requests, and kills it only if it outlives that wait. It always runs,
on errors and interrupts too. The server's stdout and stderr go to a file in `log_dir`.

`resident_bytes(url)` reads a server's RSS from its `/metrics` (prometheus_client's process collector), and
`ServerProcess.resident_bytes()` its own process's from /proc.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from paradecode.graphs.errors import ParadecodeError

logger = logging.getLogger(__name__)

RSS_METRIC = "process_resident_memory_bytes"  # prometheus_client's default process collector (Linux)
TAIL_CHARS = 3000  # of the server's output, in an error


class ServerFailed(ParadecodeError):
    """A server did not start (it exited, or /health did not answer in time)."""


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`paradecode-serve EXPORT --port P FLAGS...` in a subprocess; `url` once it is up."""

    def __init__(
        self,
        export: Path,
        flags: list[str],
        log_dir: Path,
        *,
        name: str = "server",
        port: int | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 60.0,
    ):
        self.port = free_port() if port is None else port  # a given port: a restart where clients expect it
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "paradecode.runtime.serve.cli",
            str(export),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.name = name
        self.log = Path(log_dir) / f"{name}.log"
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        try:
            self.wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.process.poll() is not None:
                    raise ServerFailed(
                        f"{self.name}: paradecode-serve exited with code {self.process.returncode} before it served "
                        f"(command: {' '.join(self.command)}); its output ends with:\n{self.tail()}"
                    )
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        logger.info("%s: serving at %s (pid %d)", self.name, self.url, self.process.pid)
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServerFailed(
                        f"{self.name}: paradecode-serve did not answer {self.url}/health within "
                        f"{self.start_timeout:g} s (a large export takes longer to load: give it more time); its "
                        f"output ends with:\n{self.tail()}"
                    )
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then wait for in-flight requests to finish; SIGKILL after `stop_timeout` seconds."""
        process = self.process
        if process is None:
            return
        if process.poll() is not None:
            logger.info("%s: had exited (exit code %d)", self.name, process.returncode)
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s: still running %g s after SIGTERM; killing it", self.name, self.stop_timeout)
            process.kill()
            process.wait()
        logger.info("%s: stopped (exit code %d)", self.name, process.returncode)

    def resident_bytes(self) -> float:
        """The server process's resident memory now (VmRSS, Linux), in bytes; raises ServerFailed once it has exited."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError as err:
            raise ServerFailed(f"{self.name}: cannot read its memory ({err}): has it exited?") from err
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
        raise ServerFailed(f"{self.name}: /proc/{self.process.pid}/status has no VmRSS (has it exited?)")

    def tail(self) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as err:
            return f"(could not read {self.log}: {err})"
        return text[-TAIL_CHARS:] or "(nothing)"


def resident_bytes(url: str) -> float | None:
    """The server's resident memory from its /metrics, in bytes; None where it does not report it."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{url}/metrics", timeout=10.0)
    except httpx.HTTPError as err:
        logger.warning("%s/metrics: %s: no RSS figure", url, err)
        return None
    if response.status_code != 200:
        logger.warning("%s/metrics answered %d: no RSS figure", url, response.status_code)
        return None
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == RSS_METRIC:
                return float(sample.value)
    logger.warning("%s/metrics has no %s (not Linux?): no RSS figure", url, RSS_METRIC)
    return None
