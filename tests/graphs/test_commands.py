"""The console scripts: Ctrl-C at any moment from the script's first import on exits 130 with one line, no traceback.

The commands import torch and onnxruntime for seconds before their `run_command` begins; Ctrl-C there printed a
`KeyboardInterrupt` traceback (or an `ImportError` or `RecursionError` from a half-imported module) and exited 1 or
died of the signal. Each case runs the installed script, as a user does, and interrupts it at several moments. (The
interpreter's own start, some 50 ms before the script's first line, is outside any code of ours.)
"""

import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paradecode.graphs import commands
from tests.conftest import REPO

SCRIPTS = Path(sys.executable).parent
SIGTERM_CAUGHT = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status's SigCgt: Python leaves SIGTERM alone by default
AT_ONCE = 0.0  # as soon as the script's handler is in place (/proc shows SIGTERM caught): before the command's imports
DELAYS = (AT_ONCE, 0.5, 1.0, 2.0)  # seconds after the start: each command is still importing or working then


def caught_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # the process is gone
        return True
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & SIGTERM_CAUGHT)


def interrupted(argv: list[str], delay: float) -> subprocess.CompletedProcess:
    """Run argv, send SIGINT `delay` seconds after the start (AT_ONCE: as soon as its handler is in place)."""
    started = time.monotonic()
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if delay == AT_ONCE:
            while not caught_sigterm(process.pid) and time.monotonic() - started < 10:
                time.sleep(0.001)
        else:
            time.sleep(max(0.0, started + delay - time.monotonic()))
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def story_prompts(folder: Path) -> Path:
    """A prompts file stories260K answers (it has no chat template for the `heads` set's chats)."""
    path = folder / "prompts.txt"
    path.write_text("Once upon a time\nThe cat was\n" * 8)
    return path


CASES = {
    # prog: (its arguments, from the stories260K export and model; a path it must not leave behind)
    "paradecode-bench": lambda export, hf, tmp: (
        [export, "--no-hf", "--repeat", "100", "--json", tmp / "b.json"],
        "b.json",
    ),
    "paradecode-loadtest": lambda export, hf, tmp: ([export, "--requests", "500", "--json", tmp / "l.json"], "l.json"),
    "paradecode-train-heads": lambda export, hf, tmp: ([hf, "-o", tmp / "heads.safetensors"], "heads.safetensors"),
    "paradecode-train-draft": lambda export, hf, tmp: (
        [export, "-o", tmp / "draft.safetensors", "--data", tmp / "data", "--prompts", story_prompts(tmp)],
        "draft.safetensors",
    ),
    "paradecode-export": lambda export, hf, tmp: ([hf, "-o", tmp / "export"], "export"),
    # waits for stdin; plain decoding: ParaDecode's request on this export without trained heads warns that it will
    # not exit early, a line of its own when the interrupt, deferred during the imports, lands after the request
    "paradecode-generate": lambda export, hf, tmp: ([export, "--prompt-file", "-", "--mode", "ar"], None),
    "paradecode-serve": lambda export, hf, tmp: ([export, "--port", "0"], None),  # serves until stopped
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("prog", list(CASES))
def test_ctrl_c_at_any_moment_exits_130_with_one_line(prog, stories_export, stories_dir, tmp_path):
    for delay in DELAYS:
        folder = tmp_path / f"after-{delay}"
        folder.mkdir()
        args, leftover = CASES[prog](str(stories_export[0]), str(stories_dir / "hf"), folder)
        result = interrupted([str(SCRIPTS / prog), *map(str, args)], delay)
        moment = "at once" if delay == AT_ONCE else f"after {delay} s"
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 130, f"{prog} interrupted {moment}: exit {result.returncode}\n{result.stderr}"
        assert "Traceback" not in result.stderr, f"{prog} interrupted {moment}:\n{result.stderr}"
        said = [line for line in lines if line.startswith(f"{prog}: ")]
        assert len(said) == 1 and said[0] == lines[-1], f"{prog} interrupted {moment}:\n{result.stderr}"
        assert said[0].startswith((f"{prog}: interrupted", f"{prog}: stopped")), said
        assert leftover is None or not (folder / leftover).exists(), f"{prog} interrupted {moment} left {leftover}"


def test_every_console_script_starts_through_a_command():
    """Every script of pyproject.toml's [project.scripts] is a `Command` of paradecode.graphs.commands, so none
    imports its command's module before Ctrl-C is handled, and each names its own program and `main`."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) >= 10, scripts
    for name, target in scripts.items():
        module, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert module == "paradecode.graphs.commands" and isinstance(command, commands.Command), (name, target)
        assert command.prog == name and callable(importlib.import_module(command.module).main), command


def test_a_signal_inside_the_block_exits_at_once_and_the_handlers_come_back():
    """In a child Python: SIGTERM inside `interrupts_exit_at_once` ends the process with 143 and one line, what was
    printed before comes out first, and code after the signal never runs."""
    code = (
        "import signal, sys\n"
        "from paradecode.graphs.commands import interrupts_exit_at_once\n"
        "before = signal.getsignal(signal.SIGINT)\n"
        "with interrupts_exit_at_once('prog'):\n"
        "    pass\n"
        "assert signal.getsignal(signal.SIGINT) is before\n"
        "print('printed before', end='')\n"
        "with interrupts_exit_at_once('prog'):\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    print('after the signal')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (
        143,
        "printed before",
        "prog: interrupted (received SIGTERM)\n",
    )
