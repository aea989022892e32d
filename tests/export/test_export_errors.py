"""The exporter under misuse: signals, interrupts inside imports, an unwritable or full disk, a broken model folder.

Every case ends with a clear message and exit code and leaves nothing behind. Each test has a timeout:
a regression here tends to hang (a signal that is not handled) rather than fail.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paradecode.export import cli
from paradecode.graphs import errors
from paradecode.graphs.errors import MissingDependencyError, Terminated, UserInputError, run_command

SMALL_EXPORT = ["--max-seq-len", "16", "--exit-layers", "1", "-q"]


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
def test_run_command_takes_an_ignored_sigint_where_asked(capsys):
    """paradecode-serve's case: uvicorn stops on SIGINT whatever it inherited, so the command counts it as Ctrl-C."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        def work():
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)
            return "finished"

        assert run_command("prog", work, interrupted="stopped", take_ignored=True) == (130, None)
        assert capsys.readouterr().err == "prog: stopped\n"
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
def test_an_interrupt_during_an_import_is_raised_after_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C while torch loads aborted the process: torch runs its Python code under C++ frames while it is
    imported, and a KeyboardInterrupt raised there cannot cross them (CI: "terminate called after throwing an
    instance of 'pybind11::error_already_set'", exit -6). The handler waits for the import to end."""
    slow_module(
        tmp_path,
        monkeypatch,
        "slow_to_load",
        "import signal, time\n"
        "signal.raise_signal(signal.SIGINT)\n"
        "time.sleep(0.3)  # the import goes on: the interrupt waits for it\n"
        "LOADED = True\n",
    )
    steps = []

    def work():
        import slow_to_load

        steps.append(slow_to_load.LOADED)
        time.sleep(5)  # the interrupt, sent again once the import is over, lands here
        steps.append("not interrupted")

    started = time.monotonic()
    assert run_command("prog", work) == (130, None)
    assert steps == [True] and time.monotonic() - started < 3
    assert capsys.readouterr().err == "prog: interrupted\n"


def slow_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    """A module `name` whose import runs `body` (in the test's own process)."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.fixture
def stray_sigint():
    """A SIGINT that reaches the handler run_command restores (it would stop pytest): recorded, to assert none."""
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(30)
def test_a_second_interrupt_during_an_import_is_raised_at_once_and_cleanup_runs(
    tmp_path, monkeypatch, capsys, stray_sigint
):
    """A second Ctrl-C means now: it is raised in the import, and nothing is sent again into the cleanup."""
    slow_module(
        tmp_path,
        monkeypatch,
        "twice",
        "import signal\nsignal.raise_signal(signal.SIGINT)\nsignal.raise_signal(signal.SIGINT)\nLOADED = True\n",
    )
    steps = []

    def work():
        try:
            import twice  # noqa: F401
        finally:
            steps.append("cleanup started")
            time.sleep(0.3)  # a signal sent again by a watcher would land here
            steps.append("cleanup done")

    assert run_command("prog", work) == (130, None)
    time.sleep(0.2)
    assert steps == ["cleanup started", "cleanup done"] and stray_sigint == []
    assert capsys.readouterr().err == "prog: interrupted\n"


@pytest.mark.timeout(30)
def test_an_import_that_never_ends_still_stops_at_a_second_signal(tmp_path, monkeypatch, capsys):
    slow_module(tmp_path, monkeypatch, "endless", "import time\nwhile True:\n    time.sleep(0.01)\n")
    for delay in (0.1, 0.4):  # SIGTERM twice, as a supervisor might
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    def work():
        import endless  # noqa: F401

    started = time.monotonic()
    assert run_command("prog", work) == (143, None)
    assert time.monotonic() - started < 5
    assert capsys.readouterr().err == "prog: interrupted (received SIGTERM)\n"


@pytest.mark.timeout(30)
def test_an_interrupt_deferred_past_the_works_end_is_reported_and_not_sent_later(
    tmp_path, monkeypatch, capsys, stray_sigint
):
    """The work's last import takes the Ctrl-C, and the work returns before it is sent again: the command was
    interrupted all the same (no exit code 0), and no signal arrives after run_command has returned."""
    slow_module(tmp_path, monkeypatch, "last_import", "import signal\nsignal.raise_signal(signal.SIGINT)\n")

    def work():
        import last_import  # noqa: F401

        return "published"

    code, result = run_command("prog", work)
    time.sleep(0.2)
    assert (code, result) == (130, None) and stray_sigint == []
    assert capsys.readouterr().err == "prog: interrupted\n"


@pytest.mark.timeout(60)
def test_no_deferred_signal_is_sent_after_the_block_has_ended(tmp_path, monkeypatch, capsys, stray_sigint):
    """The watcher wakes (POLL_S) and waits for the GIL while the work runs Python: a work that ends in that
    window must not get the signal sent after run_command restored the handlers (it was, every time)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # the watcher waits this long for the GIL while the work spins
    try:
        for trial in range(5):
            slow_module(tmp_path, monkeypatch, f"spun{trial}", "import signal\nsignal.raise_signal(signal.SIGINT)\n")

            def work(name=f"spun{trial}"):
                __import__(name)
                end = time.perf_counter() + errors.POLL_S * 1.5  # past the watcher's first look
                while time.perf_counter() < end:
                    pass

            assert run_command("prog", work)[0] == 130
            time.sleep(0.1)
    finally:
        sys.setswitchinterval(interval)
    assert stray_sigint == []
    assert capsys.readouterr().err == "prog: interrupted\n" * 5


@pytest.mark.timeout(30)
def test_a_deferred_interrupt_is_seen_at_once_by_a_point_of_no_return(tmp_path, monkeypatch, capsys, stray_sigint):
    """An export checks raise_if_interrupted() before publishing: a Ctrl-C an import took a moment before must
    stop it there, not after the folder is published."""
    slow_module(tmp_path, monkeypatch, "just_before", "import signal\nsignal.raise_signal(signal.SIGINT)\n")
    published = []

    def work():
        import just_before  # noqa: F401

        errors.raise_if_interrupted()
        published.append(True)

    assert run_command("prog", work) == (130, None) and published == []
    time.sleep(0.1)
    assert stray_sigint == [] and capsys.readouterr().err == "prog: interrupted\n"


@pytest.mark.timeout(30)
def test_run_command_never_swallows_an_unexpected_error():
    with pytest.raises(RuntimeError, match="a bug"):
        run_command("prog", raise_(RuntimeError("a bug")))


# --- SIGTERM during a real export ----------------------------------------------------------------


@pytest.mark.slow
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


# --- an output folder that cannot be written -----------------------------------------------------


def refuse_model_work(monkeypatch):
    """The writability check must come before any work on the model."""
    from paradecode.export import pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("the model was touched before the output folder was checked")

    monkeypatch.setattr(pipeline, "resolve_model", too_late)
    monkeypatch.setattr(pipeline, "load_hf_model", too_late)


def chmod_is_ignored(folder: Path) -> bool:
    """True when files can be created in `folder` despite its mode (root, with CAP_DAC_OVERRIDE)."""
    try:
        (folder / "probe").touch()
    except PermissionError:
        return False
    (folder / "probe").unlink()
    return True


@pytest.mark.timeout(60)
def test_read_only_parent_is_refused_before_any_work(model_dirs, tmp_path, capsys, monkeypatch):
    refuse_model_work(monkeypatch)
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if chmod_is_ignored(parent):
            pytest.skip(
                "this process bypasses file modes (root): a chmod 0o555 folder stays writable; "
                "test_output_under_proc_is_refused_before_any_work covers the refusal with a folder root cannot write"
            )
        code, out = run_export([model_dirs["gpt2"], "-o", parent / "deeper" / "out"], capsys)
    finally:
        parent.chmod(0o755)
    assert code == 2, out
    assert f"{parent} is not writable (Permission denied)" in out and "-o" in out
    assert list(parent.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not Path("/proc/self").is_dir(), reason="needs Linux /proc, a folder no user, root included, can create files in"
)
def test_output_under_proc_is_refused_before_any_work(model_dirs, tmp_path, capsys, monkeypatch):
    refuse_model_work(monkeypatch)
    code, out = run_export([model_dirs["gpt2"], "-o", "/proc/paradecode-test-export/out"], capsys)
    assert code == 2, out
    assert "cannot create the output folder /proc/paradecode-test-export/out: /proc is not writable" in out
    assert "Traceback" not in out


@pytest.mark.timeout(60)
def test_output_below_a_file_is_refused(model_dirs, tmp_path, capsys, monkeypatch):
    refuse_model_work(monkeypatch)
    (tmp_path / "a-file").write_text("x")
    code, out = run_export([model_dirs["gpt2"], "-o", tmp_path / "a-file" / "out"], capsys)
    assert code == 2 and f"{tmp_path / 'a-file'} is a file, not a folder" in out


# --- the disk fills up while writing -------------------------------------------------------------


def fail_onnx_save(code):
    def install(monkeypatch):
        from paradecode.export import pipeline

        def full(model, path):
            raise OSError(code, os.strerror(code), str(path))

        monkeypatch.setattr(pipeline, "save_onnx", full)

    return install


def fail_weights_save(monkeypatch):
    """safetensors (Rust) reports the OS error as text; this is its message on a full tmpfs."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("install", "reason"),
    [
        (fail_onnx_save(errno.ENOSPC), "no space left on device"),
        (fail_onnx_save(errno.EDQUOT), "disk quota exceeded"),
        (fail_weights_save, "no space left on device"),
    ],
    ids=["onnx-enospc", "onnx-edquot", "weights-enospc"],
)
def test_a_full_disk_is_reported_and_leaves_nothing(model_dirs, tmp_path, capsys, monkeypatch, install, reason):
    install(monkeypatch)
    out = tmp_path / "deep" / "out"
    code, message = run_export([model_dirs["gpt2"], "-o", out, *SMALL_EXPORT], capsys)
    assert code == 1, message
    assert f"paradecode-export: error: {reason} while writing {out}: the export needs at least " in message
    assert " MB; free space or choose another -o. Nothing was written." in message
    assert "Traceback" not in message
    assert list(tmp_path.iterdir()) == [], "the export left files or the parent folder it created"


@pytest.mark.timeout(30)
def test_other_write_errors_are_not_disguised(tmp_path):
    from paradecode.export.files import staged_folder

    with pytest.raises(OSError) as raised, staged_folder(tmp_path / "out", force=False) as folder:
        (folder / "half").write_text("x")
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert raised.type is OSError and raised.value.errno == errno.EIO
    assert_nothing_written(tmp_path)


@pytest.mark.timeout(30)
def test_a_safetensors_error_without_an_os_error_passes_through(tmp_path, monkeypatch):
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from paradecode.export.files import save_weights

    def broken(*args, **kwargs):
        raise SafetensorError("Error while serializing: tensor invalid")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(SafetensorError, match="tensor invalid"):
        save_weights(tmp_path / "w.safetensors", {"w": torch.zeros(2)}, "float32")


@pytest.mark.timeout(30)
def test_an_interrupt_while_replacing_puts_the_old_output_back(tmp_path, monkeypatch):
    from paradecode.export.files import staged_folder

    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    real_rename = Path.rename

    def interrupted_publish(self, target):
        if ".partial-" in self.name:
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupted_publish)
    with pytest.raises(KeyboardInterrupt), staged_folder(out, force=True) as folder:
        (folder / "new.txt").write_text("new")
    assert (out / "mine.txt").read_text() == "keep me" and not (out / "new.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- a broken model folder -----------------------------------------------------------------------


def truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def reshape_a_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    weights[key] = weights[key][:-3].clone()  # 80 rows in the config's intermediate_size -> 77
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def garble_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')


BROKEN_MODELS = [
    pytest.param(
        truncate_weights,
        ["model.safetensors is not a readable safetensors file", "truncated", "download or save the model again"],
        id="truncated-safetensors",
    ),
    pytest.param(
        reshape_a_tensor,
        [
            "do not fit its config.json",
            "model.layers.0.mlp.up_proj.weight has shape (77, 48), the config expects (80, 48)",
            "save_pretrained",
        ],
        id="wrong-tensor-shape",
    ),
    pytest.param(
        garble_tokenizer,
        ["tokenizer.json is not a usable tokenizer file: the tokenizers library cannot read it", "delete it"],
        id="garbage-tokenizer",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("damage", "fragments"), BROKEN_MODELS)
def test_a_broken_model_folder_is_a_user_error(model_dirs, tmp_path, capsys, damage, fragments):
    model = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], model)
    damage(model)
    code, out = run_export([model, "-o", tmp_path / "out", *SMALL_EXPORT], capsys)
    assert code == 2, out
    assert f"paradecode-export: error: {model}" in out or f"the weights in {model}" in out
    for fragment in fragments:
        assert fragment in out, out
    assert "Traceback" not in out
    assert_nothing_written(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("damage", "fragments"), BROKEN_MODELS)
def test_train_heads_refuses_a_broken_model_folder(model_dirs, tmp_path, capsys, damage, fragments):
    from paradecode.export.heads import cli as train_heads

    model = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], model)
    damage(model)
    code = train_heads.main([str(model), "-o", str(tmp_path / "heads.safetensors"), "--steps", "1"])
    out = capsys.readouterr().err
    assert code == 2, out
    for fragment in fragments:
        assert fragment in out, out
    assert not (tmp_path / "heads.safetensors").exists()


@pytest.mark.timeout(60)  # a regression records data and writes untrained heads
@pytest.mark.parametrize("steps", ["0", "-3"])
def test_train_heads_refuses_fewer_than_one_step_before_any_work(model_dirs, tmp_path, capsys, monkeypatch, steps):
    """--steps 0 wrote untrained heads and exited 0."""
    from paradecode.export.heads import cli as train_heads
    from paradecode.export.heads import pipeline as heads_pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("training started with fewer than one step")

    monkeypatch.setattr(heads_pipeline, "train_exit_heads", too_late)
    heads = tmp_path / "heads.safetensors"
    with pytest.raises(SystemExit) as exited:
        train_heads.main([str(model_dirs["llama"]), "-o", str(heads), "--steps", steps])
    assert exited.value.code == 2
    assert f"argument --steps: expected a positive integer, got {steps}" in capsys.readouterr().err
    assert not heads.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(30)
def test_heads_config_refuses_fewer_than_one_step(tmp_path):
    from paradecode.export.heads.pipeline import HeadsConfig

    with pytest.raises(UserInputError, match=r"steps must be a positive integer, got 0: .* Pass --steps 1 or more"):
        HeadsConfig(model="m", output=tmp_path / "heads.safetensors", steps=0)


@pytest.mark.timeout(60)
def test_an_interrupt_a_library_swallowed_still_stops_the_export_before_it_is_published(tmp_path):
    """A signal whose exception a library caught (transformers' imports turn some into ImportError and go
    on) is remembered: the staged export is not published and the command ends as interrupted."""
    import contextlib
    import os
    import signal

    from paradecode.export.files import staged_folder
    from paradecode.graphs.errors import run_command

    output = tmp_path / "out"

    def work():
        with staged_folder(output, force=False) as folder:
            (folder / "manifest.json").write_text("{}")
            with contextlib.suppress(BaseException):  # a library swallowing the interrupt
                os.kill(os.getpid(), signal.SIGTERM)
        return "finished"

    code, result = run_command("paradecode-export", work)
    assert (code, result) == (143, None)
    assert not output.exists() and not list(tmp_path.iterdir())
