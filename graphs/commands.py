"""The console scripts (pyproject.toml's [project.scripts]): each imports its command's module and runs its `main`
with Ctrl-C covered from the script's first line.

A command's module takes seconds to import (torch, onnxruntime, transformers). Ctrl-C during those imports used to
print a `KeyboardInterrupt` traceback, or an `ImportError` or `RecursionError` where a half-imported module was
imported again, and an exception raised inside an import that native code runs can abort the process. So a script
imports and runs its command under `interrupts_exit_at_once`: a signal there ends the process at once with
"PROG: interrupted" and 128 + the signal number (130 for Ctrl-C), which is safe because nothing has been written or
started yet (or, after the work, everything was cleaned up). While the work runs, the command's `run_command` handles
the signals its own way (it unwinds the work, so that every cleanup runs), then puts this handling back.

This module imports nothing heavy: only `paradecode.graphs`, whose package imports the standard library alone.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from paradecode.graphs.errors import INTERRUPT_SIGNALS, report_interrupt


@dataclass(frozen=True)
class Command:
    """A console script: the command `prog`, whose `main(argv=None) -> int` is in `module`; `take_ignored` for a
    command that stops on SIGINT even where it was inherited as ignored (see `interrupts_exit_at_once`)."""

    prog: str
    module: str
    take_ignored: bool = False

    def __call__(self) -> int:
        with interrupts_exit_at_once(self.prog, self.take_ignored):
            return importlib.import_module(self.module).main()


export = Command("paradecode-export", "paradecode.export.cli")
generate = Command("paradecode-generate", "paradecode.runtime.cli")
train_heads = Command("paradecode-train-heads", "paradecode.export.heads.cli")
train_draft = Command("paradecode-train-draft", "paradecode.export.draft.cli")
bench = Command("paradecode-bench", "paradecode.tools.bench")
profile = Command("paradecode-profile", "paradecode.tools.profiler")
characterise = Command("paradecode-characterise", "paradecode.tools.characterise")
demo = Command("paradecode-demo", "paradecode.tools.demo")
footprint = Command("paradecode-footprint", "paradecode.tools.footprint")
# uvicorn stops the server on SIGINT whatever its inherited disposition (a shell's background job ignores it): the
# command does too, from its first line, so that it always ends with "stopped" and 130
serve = Command("paradecode-serve", "paradecode.runtime.serve.cli", take_ignored=True)
loadtest = Command("paradecode-loadtest", "paradecode.tools.load_bench")
perplexity = Command("paradecode-perplexity", "paradecode.tools.perplexity")
parity_report = Command("paradecode-parity-report", "paradecode.tools.parity_report")


@contextmanager
def interrupts_exit_at_once(prog: str, take_ignored: bool = False) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM end the process at once: "PROG: interrupted" on stderr and exit code
    128 + the signal number, without a traceback, whatever Python was doing (an import included).

    Only for code with nothing to unwind. What was printed before the signal is flushed first. A handler set inside
    the block (`run_command`'s) takes over until it puts this one back. Handlers can only be set in the main thread;
    elsewhere the current handling is left alone, and so it is for a signal the process was told to ignore (a shell's
    background job ignores SIGINT) unless `take_ignored`. The previous handlers come back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        try:
            with suppress(OSError, ValueError, RuntimeError):  # a closed pipe, or a write this signal interrupted
                sys.stdout.flush()
            report_interrupt(prog, "interrupted", signum)
        finally:
            os._exit(128 + signum)

    previous = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    taken = [s for s, old in previous.items() if take_ignored or old is not signal.SIG_IGN]
    for s in taken:
        signal.signal(s, exit_now)
    try:
        yield
    finally:
        for s in taken:
            signal.signal(s, signal.SIG_DFL if previous[s] is None else previous[s])
