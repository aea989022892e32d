"""One exception tree for the whole project, and the one path from an error to a CLI's exit code.

Every error raised on purpose derives from `ParadecodeError`. Each class carries the process exit
code the command-line tools use for it, so a CLI maps an error to an exit code in one place.
A user's mistake gets a message that says what was given, what was expected and how to fix it.

Interrupts are not errors: Ctrl-C (SIGINT) and SIGTERM unwind the stack as a `KeyboardInterrupt`
(`Terminated` for SIGTERM), so every `finally` and staged-folder cleanup runs, and `run_command`
exits with the shell's convention, 128 + the signal number: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ParadecodeError(Exception):
    """Root of every error paradecode raises on purpose."""

    exit_code = 1


class UserInputError(ParadecodeError, ValueError):
    """Bad input from the user: a wrong path, option or value. Exit code 2."""

    exit_code = 2


class UnsupportedModelError(UserInputError):
    """The model's architecture or one of its settings is not supported."""


class PromptError(UserInputError):
    """A prompt that cannot be decoded: empty, a token outside the vocabulary (a server names the prompt's field)."""


class PromptTooLongError(PromptError):
    """A prompt longer than the export's KV cache holds (a server answers it with 413)."""


class SettingError(UserInputError):
    """A request's setting that this model cannot honour (stop strings without a tokenizer, sampling without logits):
    `setting` is its GenerationConfig field, which a server names as its request's field."""

    def __init__(self, message: str, setting: str = ""):
        super().__init__(message)
        self.setting = setting


class MissingDependencyError(ParadecodeError, ImportError):
    """An optional library or the hardware it needs is missing. Exit code 3."""

    exit_code = 3


class ManifestError(ParadecodeError):
    """An export folder is incomplete, corrupt or from an incompatible version. Exit code 2."""

    exit_code = 2


class ExportChangedError(ManifestError):
    """An export folder no longer holds the files a model was loaded from (compared by content: runtime/watched.py)."""


class ValidationError(ParadecodeError):
    """An exported subgraph does not reproduce its PyTorch reference within tolerance."""


class ModelClosedError(UserInputError):
    """A call on a model after its `close()`."""


class SchedulerStallError(ParadecodeError):
    """The ParaDecode scheduler made no progress for too long (a bug: the message names what it waited for)."""


class OutOfSpaceError(ParadecodeError):
    """The disk filled up (ENOSPC) or a quota was reached (EDQUOT) while writing; nothing was left behind."""


class OutputNotWrittenError(ParadecodeError):
    """A command's output could not be written at the end of its run, although it was checked before the run began
    (its folder was removed or made read-only since, or the disk filled up). Exit code 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a command ran.

    A `KeyboardInterrupt`, not a `ParadecodeError`, on purpose: like Ctrl-C it must unwind through
    every cleanup and must not be caught by an `except Exception`.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_command(
    prog: str, work: Callable[[], object], interrupted: str = "interrupted", take_ignored: bool = False
) -> tuple[int, object]:
    """Run a command's `work()`; map paradecode errors to their exit codes with one message on stderr.

    Returns (exit code, what `work` returned or None). Every command-line tool goes through here,
    so they all report a user's mistake the same way: "PROG: error: MESSAGE" and exit code 2.
    An interrupt (see `interrupt_signal`) prints "PROG: INTERRUPTED" and returns 128 + the signal
    number, whatever exception it surfaced as, and also where `work` returned all the same (a library caught
    the interrupt, or the signal was deferred past the work's last import: `interrupts_raised`). `take_ignored`:
    see `interrupts_raised`.
    """
    with interrupts_raised(take_ignored) as received:
        try:
            result = work()
        except BaseException as err:
            signum = interrupt_signal(err, received)
            if signum is not None:
                return report_interrupt(prog, interrupted, signum), None
            if isinstance(err, ParadecodeError):
                print(f"{prog}: error: {err}", file=sys.stderr)
                return err.exit_code, None
            raise
    if received:  # a signal deferred past the work's end (it arrived during the work's last import)
        return report_interrupt(prog, interrupted, received[0]), None
    return 0, result


def report_interrupt(prog: str, interrupted: str, signum: int) -> int:
    """Say on stderr that the command was interrupted ("PROG: INTERRUPTED"); its exit code, 128 + the signal number."""
    note = "" if signum == signal.SIGINT else f" (received {signal.Signals(signum).name})"
    print(f"{prog}: {interrupted}{note}", file=sys.stderr)
    return 128 + signum


def interrupt_signal(err: BaseException, received: list[int]) -> int | None:
    """The signal that `err` stands for, or None when it is a plain error.

    An interrupt can surface as another exception: a Ctrl-C inside an import can leave a module half
    initialised, and the next import of it raises ImportError (which a library may turn into "X is
    needed"). So an error counts as an interrupt when a signal arrived during the command, or when a
    `KeyboardInterrupt` is anywhere in its chain of causes and contexts.
    """
    if received:
        return received[0]
    for link in exception_chain(err):
        if isinstance(link, Terminated):
            return link.signum
        if isinstance(link, KeyboardInterrupt):
            return signal.SIGINT
    return None


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then every exception in its chain of causes and contexts, each once."""
    pending, seen = [err], set()
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        pending += [link.__context__, link.__cause__]


POLL_S = 0.02  # how often a deferred signal's watcher looks whether the import is over


def importing(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside an import (some caller on its stack is the import machinery)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_received: list[int] = []  # the signals received inside the innermost `interrupts_raised` block


def raise_if_interrupted() -> None:
    """Raise the interrupt a signal asked for, if one arrived in the current `interrupts_raised` block.

    For points of no return (publishing an export): a library that caught the interrupt's exception and
    went on must not make an interrupted command finish as if nothing had happened.
    """
    if _received:
        raise KeyboardInterrupt if _received[0] == signal.SIGINT else Terminated(_received[0])


@contextmanager
def interrupts_raised(take_ignored: bool = False) -> Iterator[list[int]]:
    """While the block runs, SIGINT raises KeyboardInterrupt and SIGTERM raises `Terminated`.

    Yields the list of signal numbers received, in order. Handlers can only be set in the main
    thread; elsewhere the current handling is left alone, and so it is for a signal the process was told to
    ignore (a shell's background job ignores SIGINT) unless `take_ignored`: for work that stops on the signal
    all the same (uvicorn's server handles SIGINT whatever it inherited), so that it ends as an interrupt.
    The previous handlers come back afterwards.

    A signal that arrives while the main thread imports a module is deferred until the import is over: an
    import's Python code may run under a native extension's C++ frames (torch calls back into Python while it
    loads), and an exception raised there cannot cross them: the process aborts (pybind11's "terminate
    called"). A deferred signal is in the list at once (`raise_if_interrupted` and `run_command` see it). A second
    signal during the same import is raised at once (a second Ctrl-C means now). One still deferred when the
    block ends is not sent again: `run_command` reports it. Python code that native code calls back after an
    import (a compiler's callbacks) is not covered.

    Threading: a deferred signal has one watcher thread, which looks at the main thread's stack every POLL_S
    and sends the signal again, once, when no import is on it; `lock` orders that send and the block's end (no
    signal is sent after it). The handler itself runs in the main thread.
    """
    global _received
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    main = threading.main_thread().ident
    deferred: list[int] = []  # the signal waiting for an import to end (at most one; recorded in `received`)
    sent_again = threading.Event()  # the watcher sent it: the handler defers it again if an import began since
    over = threading.Event()  # the block is ending: a watcher stops, a late signal is only recorded
    lock = threading.Lock()  # a watcher's send and the block's end: one, then the other

    def watch(signum: int) -> None:
        while not over.wait(POLL_S):
            with lock:
                if over.is_set() or not deferred:  # the block ended, or a second signal raised it already
                    return
                if not importing(sys._current_frames().get(main)):
                    sent_again.set()
                    os.kill(os.getpid(), signum)
                    return

    def handler(signum, frame):
        resent = sent_again.is_set()
        sent_again.clear()
        if resent and (over.is_set() or not deferred):  # a watcher's late send: raised or recorded already
            return
        if over.is_set():  # arrived as the block ends: recorded, for the caller to report
            received.append(signum)
            return
        if importing(frame) and (resent or not deferred):  # a first signal, or sent again into a new import
            if not deferred:
                deferred.append(signum)
                received.append(signum)  # seen at once by raise_if_interrupted and interrupt_signal
            threading.Thread(target=watch, args=(deferred[0],), name="deferred-interrupt", daemon=True).start()
            return
        if not resent:  # a new signal (a second one during an import included); a deferred one is recorded
            received.append(signum)
        deferred.clear()
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    previous = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    taken = [s for s, old in previous.items() if take_ignored or old is not signal.SIG_IGN]
    for s in taken:
        signal.signal(s, handler)
    outer, _received = _received, received
    try:
        yield received
    finally:
        with lock:
            over.set()
            deferred.clear()  # recorded in `received` when it arrived
        _received = outer
        for s in taken:
            signal.signal(s, signal.SIG_DFL if previous[s] is None else previous[s])
