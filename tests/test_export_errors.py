"""The exporter under misuse: signals, interrupts inside imports, an unwritable or full disk, a broken model folder.

Every case ends with a clear message and exit code and leaves nothing behind. Each test has a timeout:
a regression here tends to hang (a signal that is not handled) rather than fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paradecode.export import cli
from paradecode.graphs.errors import MissingDependencyError, Terminated, UserInputError, run_command

SMALL_EXPORT = ["--max-seq-len", "16", "--exit-layers", "1", "--no-fused-exits", "-q"]


def run_export(argv, capsys):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_nothing_written(parent: Path, name: str = "out") -> None:
    assert not (parent / name).exists(), f"{parent / name} was written"
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    assert not leftovers, f"staging folders left behind: {leftovers}"


# --- run_command: every interrupt is an interrupt, whatever it surfaced as ------------------------


def import_error_caused_by_interrupt():
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        import_error = ImportError("partially initialized module 'onnxruntime'")
        import_error.__context__ = interrupt
    raise MissingDependencyError("onnxruntime is needed to validate the exported graphs") from import_error


def import_error_inside_interrupt_handling():
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise ImportError("cannot import name 'InferenceSession'") from None  # the context stays recorded


def error_after_a_swallowed_sigint():
    try:
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass  # as a library's import machinery might
    raise MissingDependencyError("onnxruntime is needed to validate the exported graphs")


def sigterm_to_self():
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100):
        time.sleep(0.05)
    return "SIGTERM did not interrupt"


def raise_(err):
    def work():
        raise err

    return work


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("work", "code", "message"),
    [
        (raise_(KeyboardInterrupt()), 130, "prog: stopped\n"),
        (import_error_caused_by_interrupt, 130, "prog: stopped\n"),
        (import_error_inside_interrupt_handling, 130, "prog: stopped\n"),
        (error_after_a_swallowed_sigint, 130, "prog: stopped\n"),
        (raise_(Terminated()), 143, "prog: stopped (received SIGTERM)\n"),
        (sigterm_to_self, 143, "prog: stopped (received SIGTERM)\n"),
        (raise_(UserInputError("bad -o")), 2, "prog: error: bad -o\n"),
        (raise_(MissingDependencyError("onnxruntime is needed")), 3, "prog: error: onnxruntime is needed\n"),
    ],
    ids=[
        "keyboard-interrupt",
        "missing-dependency-caused-by-interrupt",
        "import-error-in-interrupt-context",
        "error-after-swallowed-sigint",
        "terminated",
        "real-sigterm",
        "user-input-error",
        "missing-dependency",
    ],
)
def test_run_command_maps_interrupts_and_errors(work, code, message, capsys):
    fallback = []  # a SIGTERM that reaches this handler was not caught by run_command (and kills no pytest)

    def record(signum, frame):
        fallback.append(signum)

    previous = signal.signal(signal.SIGTERM, record)
    try:
        assert run_command("prog", work, "stopped") == (code, None)
        assert signal.getsignal(signal.SIGTERM) is record, "run_command did not restore the SIGTERM handler"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not fallback, "the signal reached the handler run_command should have replaced"
    assert capsys.readouterr().err == message


@pytest.mark.timeout(30)
def test_run_command_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = {}

    def work():
        seen.update({s: signal.getsignal(s) for s in before})
        return "done"

    assert run_command("prog", work) == (0, "done")
    assert all(seen[s] is not before[s] for s in before), "no handler was installed while the work ran"
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.timeout(30)
def test_run_command_leaves_an_ignored_sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell does for a background job
    try:

        def work():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.1)
            return "finished"

        assert run_command("prog", work) == (0, "finished")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(30)
def test_run_command_off_the_main_thread(capsys):
    results = []
    thread = threading.Thread(target=lambda: results.append(run_command("prog", raise_(KeyboardInterrupt()))))
    thread.start()
    thread.join()
    assert results == [(130, None)]
    assert capsys.readouterr().err == "prog: interrupted\n"


@pytest.mark.timeout(30)
def test_run_command_never_swallows_an_unexpected_error():
    with pytest.raises(RuntimeError, match="a bug"):
        run_command("prog", raise_(RuntimeError("a bug")))


# --- SIGTERM during a real export ----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_sigterm_during_an_export_cleans_up_and_exits_143(stories_dir, tmp_path):
    script = Path(sys.executable).parent / "paradecode-export"
    out = tmp_path / "out"
    process = subprocess.Popen(
        [str(script), str(stories_dir / "hf"), "-o", str(out), "--max-seq-len", "32", "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob(".out.partial-*")):
            assert process.poll() is None, (
                f"the export ended before its staged folder appeared: {process.stderr.read()}"
            )
            assert time.monotonic() < deadline, "the staged folder never appeared"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 143, stderr
    assert "paradecode-export: interrupted; nothing was written (received SIGTERM)" in stderr
    assert "Traceback" not in stderr
    assert "wrote" not in stdout
    assert_nothing_written(tmp_path)
    assert list(tmp_path.iterdir()) == []
