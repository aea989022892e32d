"""A peer decoding in a child process of its own, so that its crash ends that peer, not the benchmark.

llama-cpp-python built with its default native flags on an Intel CPU with AMX loaded SmolLM2's GGUF and then
segfaulted inside `llama_decode` on an 8-token prompt, taking the whole `paradecode-bench` process with it. So every
peer runs in a `PeerProcess`: a `PeerRunner` whose `load` starts a child (multiprocessing's spawn: a fresh
interpreter that shares nothing with the parent's threads and onnxruntime sessions), which builds the real runner
with `factory(**arguments)` and loads it; each `timed` call sends the prompt and gets back the tokens, their
`time.perf_counter()` stamps taken in the child, the speculation counts and the child's peak RSS growth. On Linux
perf_counter is CLOCK_MONOTONIC, one clock for every process, so the stamps time the peer's decoding alone: the pipe
is outside them. A child that dies raises `PeerCrashed`, naming the signal that killed it and, for llama.cpp, the
build that avoids the known crash; `harness.measure` leaves the peer out of the rest of the run and says why.

Threading model: one thread (the harness's) calls a PeerProcess; its child serves one call at a time, in order.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

from paradecode.graphs.errors import ParadecodeError
from paradecode.tools.harness import ModeFailed, peak_rss_reset, status_mb
from paradecode.tools.peers import PeerOutput, PeerRunner, TimedOutput

START_SECONDS = 600  # a child's load: onnxruntime-genai's model or llama.cpp's GGUF read, never a build
CALL_SECONDS = 1800  # one prompt's decoding: a peer that takes longer has hung, and is left out as one that crashed
STOP_SECONDS = 10  # a child's close before it is killed

# llama-cpp-python's build without the AMX kernels that crashed (its other x86 kernels kept): the fix the crash names
LLAMA_CPP_BUILD = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
    '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_INT8=OFF" '
    "pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python"
)
ADVICE = {
    "llama.cpp": "llama-cpp-python built with its native flags crashes this way inside llama_decode on some Intel "
    f"CPUs with AMX; rebuild it without the AMX kernels: `{LLAMA_CPP_BUILD}`."
}


class PeerCrashed(ModeFailed):
    """A peer's process died (a signal, or an exit without an answer); the benchmark goes on without it."""


class PeerProcess(PeerRunner):
    """`factory(threads=..., max_seq_len=..., eos_token_ids=..., **options)` (a PeerRunner class, or any picklable
    callable making one) loaded and called in a child process."""

    def __init__(
        self,
        factory: Callable[..., PeerRunner],
        *,
        threads: int,
        max_seq_len: int,
        eos_token_ids: Sequence[int] = (),
        **options: Any,
    ):
        super().__init__(threads=threads, max_seq_len=max_seq_len, eos_token_ids=eos_token_ids)
        self.factory = factory
        self.name = getattr(factory, "name", getattr(factory, "__name__", "peer"))
        self.arguments = {**options, "threads": threads, "max_seq_len": max_seq_len, "eos_token_ids": eos_token_ids}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection = None

    def timed(self, ids: Sequence[int], max_new_tokens: int) -> TimedOutput:
        self._check_loaded()
        return self._call(([int(i) for i in ids], int(max_new_tokens)), f"decoding a {len(ids)}-token prompt")

    def generate(self, ids, max_new_tokens, on_token=None) -> PeerOutput:
        """`PeerRunner.generate`, but `on_token` hears of each token once the call has ended (`timed` has the times
        at which they arrived)."""
        timed = self.timed(ids, max_new_tokens)
        for token in timed.output.token_ids if on_token is not None else ():
            on_token(token)
        return timed.output

    def _load(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=serve, args=(child, self.factory, self.arguments), name=f"peer {self.name}", daemon=True
        )
        self._process.start()
        child.close()  # the child's end lives in the child alone: its death is our end's EOF
        try:
            self._answer("loading", START_SECONDS)
        except BaseException:
            self._stop()
            raise

    def _close(self) -> None:
        self._stop()

    def _call(self, call, doing: str):
        try:
            self._connection.send(call)
        except OSError:  # the child is gone already
            return self._answer(doing, 0)
        return self._answer(doing, CALL_SECONDS)

    def _answer(self, doing: str, timeout: float):
        """The child's answer to the last call: its value, its error raised here, or PeerCrashed."""
        process = self._process
        try:
            if not self._connection.poll(timeout):
                self._loaded = False
                self._stop()
                raise PeerCrashed(f"{self.name}: its process gave no answer within {timeout:g} s of {doing}.")
            kind, value = self._connection.recv()
        except (EOFError, OSError):
            self._loaded = False
            self._stop()  # joined (killed if it lingers) and the pipe closed
            raise PeerCrashed(crash_message(self.name, process.exitcode, doing)) from None
        if kind == "error":
            raise value
        return value

    def _stop(self) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        with suppress(OSError):  # a child gone already
            self._connection.send(None)  # close the runner and leave
        process.join(STOP_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()
        self._connection.close()


def crash_message(name: str, exitcode: int | None, doing: str) -> str:
    """What to tell a user whose peer's process died with `exitcode` (negative: the signal's number)."""
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"ended (exit code {exitcode}) without an answer"
    advice = ADVICE.get(name, "run it alone to see why.")
    return f"{name} crashed: its process {how} while {doing}; the benchmark goes on without it. {advice}"


def serve(connection, factory: Callable[..., PeerRunner], arguments: dict[str, Any]) -> None:
    """The child: make and load the runner, answer ("ok", value) or ("error", exception) to each call until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C at the terminal is the parent's: it closes its children
    try:
        runner = factory(**arguments).load()
    except Exception as err:
        connection.send(("error", transferable(err)))
        return
    connection.send(("ok", None))
    try:
        while (call := connection.recv()) is not None:
            ids, max_new_tokens = call
            before = peak_rss_reset()
            try:
                timed = runner.timed(ids, max_new_tokens)
            except Exception as err:
                connection.send(("error", transferable(err)))
                continue
            peak = status_mb("VmHWM") if before is not None else None
            connection.send(("ok", timed if peak is None else timed.with_peak(max(0.0, peak - before))))
    except EOFError:  # the parent is gone
        pass
    finally:
        runner.close()


def transferable(err: Exception) -> Exception:
    """`err` as the parent can raise it: a paradecode error as it is, anything else as a ParadecodeError that says
    what it was (a library's exception class may not pickle, or not exist in the parent)."""
    if isinstance(err, ParadecodeError):
        return err
    return ParadecodeError(f"{type(err).__name__}: {err}")
