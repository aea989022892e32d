"""The benchmark's peers (tools/peers.py, tools/peer_models.py): arguments, errors, runners, agreement.

Argument and error tests need none of the peers' packages. The runner tests need theirs and skip,
saying so, without them: onnxruntime-genai (a wheel) builds its model from the demo model and from a
tiny GGUF written in-process, and must decode exactly as transformers' greedy `generate` does in fp32;
llama-cpp-python (compiled from source, so not in the test extra) runs the tiny GGUF; OpenVINO GenAI runs
stories260K as optimum-intel converts it. optimum-intel requires transformers < 5.6, so it cannot join the test
environment: those tests take the Python that has it from PARADECODE_OPENVINO_CONVERTER (else this one, if it has
optimum-intel) and skip, saying so, without one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paradecode.export.source import ModelSource
from paradecode.graphs.errors import MissingDependencyError, UnsupportedModelError, UserInputError
from paradecode.tools import bench, harness, peer_models, peers, reporting
from tests.tiny_gguf import BOS_ID, write_tiny_gguf
from tests.tools.stand_in_peers import CountingPeer, CrashingPeer

DEMO_MODEL = Path(__file__).resolve().parents[2] / "tools" / "demo_model"
NEW_TOKENS = 24


def genai_missing() -> str | None:
    missing = peers.missing_packages(["ort-genai"])
    if not missing:
        return None
    return f"onnxruntime-genai's packages are not installed ({', '.join(missing)}; `pip install 'paradecode[peers]'`)"


needs_genai = pytest.mark.skipif(genai_missing() is not None, reason=genai_missing() or "")
needs_llama_cpp = pytest.mark.skipif(
    bool(peers.missing_packages(["llama.cpp"])),
    reason="llama-cpp-python is not installed (it compiles llama.cpp from source: `pip install 'paradecode[peers]'`)",
)
needs_openvino = pytest.mark.skipif(
    bool(peers.missing_packages(["openvino"])),
    reason="openvino-genai is not installed (not in the test extra: `pip install 'paradecode[peers]'`)",
)


def hide_modules(monkeypatch, *names: str) -> None:
    """Make importlib.util.find_spec report `names` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def run_bench(argv, capsys) -> tuple[int, str]:
    code = bench.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# --- arguments and errors, without the packages ----------------------------------------------------------


def test_peers_flag_accepts_the_known_names_only(capsys):
    args = bench.build_parser().parse_args(["DIR", "--peers", "llama.cpp,ort-genai"])
    assert args.peers == ("llama.cpp", "ort-genai") and args.peer_precision == "int4"
    assert args.openvino_weights == "int8" and args.openvino_converter is None
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args(["DIR", "--peers", "ort-genai,vllm"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--peers 'ort-genai,vllm': expected comma-separated values from ort-genai, llama.cpp, openvino; not 'vllm'"
        in err
    )
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["DIR", "--peers", "ort-genai", "--peer-precision", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    argv = ["DIR", "--peers", "openvino", "--openvino-weights", "int4", "--openvino-converter", "/envs/ov/bin/python"]
    args = bench.build_parser().parse_args(argv)
    assert args.peers == ("openvino",) and args.openvino_weights == "int4"
    assert args.openvino_converter == Path("/envs/ov/bin/python")
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["DIR", "--peers", "openvino", "--openvino-weights", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_peer_settings_validate_themselves(tmp_path):
    settings = peers.PeerSettings(("ort-genai",), cache=tmp_path)
    assert settings.precision == "int4" and settings.threads >= 1 and settings.source is None
    with pytest.raises(UserInputError, match=r"distinct names from ort-genai, llama.cpp, openvino; not 'vllm'"):
        peers.PeerSettings(("vllm",))
    with pytest.raises(UserInputError, match="distinct names"):
        peers.PeerSettings(("llama.cpp", "llama.cpp"))
    with pytest.raises(UserInputError, match=r"\(none\)"):
        peers.PeerSettings(())
    with pytest.raises(UserInputError, match="expected one of int4, fp32"):
        peers.PeerSettings(("ort-genai",), precision="fp16")
    with pytest.raises(UserInputError, match="positive integer"):
        peers.PeerSettings(("ort-genai",), threads=0)
    settings = peers.PeerSettings(
        ("openvino",), openvino_weights="int4", openvino_converter=Path("/envs/ov/bin/python")
    )
    assert settings.openvino_weights == "int4" and peers.PeerSettings(("openvino",)).openvino_converter is None
    with pytest.raises(UserInputError, match=r"OpenVINO weights 'int3': expected one of int8, int4, fp32"):
        peers.PeerSettings(("openvino",), openvino_weights="int3")


@pytest.mark.parametrize(
    ("hidden", "peer_list", "named"),
    [
        (("onnxruntime_genai",), "ort-genai", ["onnxruntime-genai"]),
        (("onnxruntime_genai", "onnx_ir", "llama_cpp"), "ort-genai,llama.cpp", ["onnxruntime-genai, onnx-ir", "llama"]),
        (("llama_cpp",), "llama.cpp", ["llama-cpp-python"]),
        (("openvino_genai",), "openvino", ["openvino-genai"]),
        (("openvino_genai", "llama_cpp"), "openvino,llama.cpp", ["openvino-genai, llama-cpp-python"]),
    ],
)
def test_a_missing_peer_package_is_named_before_the_export_is_read(hidden, peer_list, named, monkeypatch, capsys):
    hide_modules(monkeypatch, *hidden)
    code, out = run_bench(["/no/such/export", "--peers", peer_list], capsys)
    assert code == 3, out  # MissingDependencyError, before the (missing) export is opened
    assert f"--peers {peer_list} needs " in out and "pip install 'paradecode[peers]'" in out, out
    assert all(name in out for name in named), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peer-source", "smollm2"], "--peer-source sets up --peers: add --peers"),
        (["--openvino-converter", "/envs/ov/bin/python"], "--openvino-converter sets up --peers: add --peers"),
        (["--peers", "ort-genai", "--temperature", "0.7"], "--peers compares greedy decoding"),
        (["--peers", "ort-genai", "--device", "cuda"], "use --device cpu"),
    ],
)
def test_peer_options_that_cannot_work_are_refused_up_front(argv, message, capsys):
    code, out = run_bench(["/no/such/export", *argv], capsys)
    assert code == 2 and message in out, out


def test_importing_bench_imports_no_peer_package():
    code = (
        "import sys, paradecode.tools.bench, paradecode.tools.peers, paradecode.tools.peer_models\n"
        "peers = ('onnxruntime_genai', 'onnx_ir', 'llama_cpp', 'openvino', 'openvino_genai', 'optimum')\n"
        "loaded = sorted(m for m in peers if m in sys.modules)\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama_cpp_needs_a_gguf_source(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"llama.cpp runs GGUF files.*--peer-source FILE.gguf"):
        peer_models.gguf_file_of(ModelSource("folder", tmp_path))
    gguf = ModelSource("m.gguf", tmp_path, gguf_file="m.gguf")
    assert peer_models.gguf_file_of(gguf) == tmp_path / "m.gguf"


def test_an_export_whose_source_is_not_here_asks_for_peer_source():
    manifest = SimpleNamespace(model={"source": "owner/not-downloaded", "weights_sha256": "0" * 64})
    with pytest.raises(UserInputError, match=r"'owner/not-downloaded'.*Pass --peer-source MODEL"):
        peer_models.peer_source(None, manifest)


def test_genai_builder_needs_a_tokenizer_in_the_folder(tmp_path):
    from tests.tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path / "model")
    source = ModelSource("tiny", tmp_path / "model")
    with pytest.raises(UnsupportedModelError, match="needs the model's tokenizer"):
        peer_models.build_genai_model(source, "fp32", tmp_path / "cache" / "fp32", weights="w", version="v")
    assert not (tmp_path / "cache").exists(), "nothing is written for a model the builder cannot build"


def test_a_failed_build_says_why_keeps_its_log_and_leaves_no_model(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_models, "BUILDER", "paradecode_no_such_builder")  # `python -m` of it fails at once
    folder = tmp_path / "cache" / "int4"
    source = ModelSource(str(DEMO_MODEL), DEMO_MODEL)
    with pytest.raises(UnsupportedModelError, match=r"could not build the int4 CPU model") as error:
        peer_models.build_genai_model(source, "int4", folder, weights="w", version="v")
    assert "No module named paradecode_no_such_builder" in str(error.value) and "ort-genai out of --peers" in str(
        error.value
    )
    assert not folder.exists() and sorted(p.name for p in folder.parent.iterdir()) == ["int4.build.log"]


# --- OpenVINO's converter and its cache (faked conversions) ----------------------------------------------

CONVERTER_VERSIONS = {"optimum-intel": "2.2.0", "openvino": "2026.4.1", "nncf": "3.4.0"}


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_without_a_converter_one_is_made_once_in_the_peer_cache(tmp_path, monkeypatch):
    """This Python lacks optimum-intel: a venv is made in the cache with the pinned requirements (torch's CPU build
    first, optimum-intel without its dependencies), marked ready last, then asked for its versions; a second call
    reuses it; one left unfinished is made again; a failing step is refused, naming it and its log."""
    calls: list[list[str]] = []
    fail_at: list[str] = []

    def run_logged(command, log, *, append=False):
        calls.append(command)
        if command[1:3] == ["-m", "venv"]:  # the environment's python: a fake that answers with versions
            (Path(command[3]) / "bin").mkdir(parents=True)
            executable(Path(command[3]) / "bin" / "python", f"#!/bin/sh\necho '{json.dumps(CONVERTER_VERSIONS)}'\n")
        if fail_at and fail_at[0] in command:
            return 1, "ERROR: no matching distribution"
        return 0, ""

    monkeypatch.setattr(peer_models, "run_logged", run_logged)
    monkeypatch.setattr(
        sys, "executable", str(executable(tmp_path / "bare", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n'))
    )
    cache = tmp_path / "cache"
    converter = peer_models.openvino_converter(None, cache)
    folder = cache / peer_models.CONVERTER_ENVIRONMENT
    assert converter.python == folder / "bin" / "python" and converter.versions == CONVERTER_VERSIONS
    python = str(folder / "bin" / "python")
    assert calls[0] == [sys.executable, "-m", "venv", str(folder)]
    assert calls[1] == [python, "-m", "pip", "install", "-q", "torch==2.13.0"]
    assert calls[-1] == [python, "-m", "pip", "install", "-q", "--no-deps", "optimum-intel==2.2.0"]
    assert (folder / peer_models.READY).is_file()
    calls.clear()
    assert peer_models.openvino_converter(None, cache).python == converter.python and calls == []  # made once

    (folder / peer_models.READY).unlink()  # as if stopped before the end: made again, from nothing
    (folder / "stale").write_text("x")
    fail_at.append("optimum-intel==2.2.0")
    with pytest.raises(
        UserInputError, match=r"converter environment failed: `.*optimum-intel==2.2.0` exited with code 1"
    ):
        peer_models.openvino_converter(None, cache)
    assert not (folder / "stale").exists() and not (folder / peer_models.READY).exists()


def test_the_openvino_converter_must_be_a_python_with_optimum_intel(tmp_path):
    with pytest.raises(UserInputError, match=r"--openvino-converter .*/no/python: expected a Python .*not be run"):
        peer_models.openvino_converter(tmp_path / "no" / "python")
    failing = executable(tmp_path / "failing", "#!/bin/sh\necho 'not a python' >&2\nexit 3\n")
    with pytest.raises(UserInputError, match=r"exited with code 3 \('not a python'\)"):
        peer_models.openvino_converter(failing)
    bare = executable(tmp_path / "bare-python", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # no site-packages
    with pytest.raises(MissingDependencyError) as error:
        peer_models.openvino_converter(bare)
    message = str(error.value)
    assert f"optimum-intel, and --openvino-converter {bare} lacks optimum-intel, openvino, nncf" in message
    assert "requires transformers < 5.6" in message and "pass --openvino-converter DIR/bin/python" in message
    answering = executable(tmp_path / "python", f"#!/bin/sh\necho '{json.dumps(CONVERTER_VERSIONS)}'\n")
    converter = peer_models.openvino_converter(answering)
    assert converter.python == answering and converter.versions == CONVERTER_VERSIONS
    assert converter.key == "openvino-2026.4.1-optimum-intel-2.2.0"


def fake_conversion(calls: list, code: int = 0):
    """A stand-in for `run_logged` running optimum-intel: records the command, writes a model into its output folder
    (the last argument) and its log, and exits with `code`."""

    def run(command, log):
        calls.append(command)
        (Path(command[-1]) / "openvino_model.xml").write_text("<net/>")
        log.write_text("converting\nboom\n" if code else "converted\n")
        return code, log.read_text().strip()

    return run


def test_openvino_conversions_are_kept_by_source_weights_and_converter_versions(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(peer_models, "run_logged", fake_conversion(calls))
    converter = peer_models.OpenVinoConverter(Path("/envs/ov/bin/python"), dict(CONVERTER_VERSIONS))
    source = ModelSource(str(DEMO_MODEL), DEMO_MODEL)
    sha = source.identity()["weights_sha256"]
    folder = peer_models.openvino_model_folder(source, "int4", tmp_path, converter)
    assert folder == tmp_path / sha / "openvino-2026.4.1-optimum-intel-2.2.0" / "int4"
    (command,) = calls
    assert command[:5] == ["/envs/ov/bin/python", "-m", "optimum.commands.optimum_cli", "export", "openvino"]
    assert command[command.index("--model") + 1] == str(DEMO_MODEL) and "--disable-convert-tokenizer" in command
    assert " --task text-generation-with-past --weight-format int4 --group-size 32 --ratio 1.0 " in " ".join(command)
    assert Path(command[-1]).parent == folder.parent and Path(command[-1]).name.startswith(".int4.partial-")
    record = json.loads((folder / "conversion.json").read_text())
    assert record["weights"] == "int4" and record["weights_sha256"] == sha and record["converter"] == CONVERTER_VERSIONS
    assert record["command"][0] == "python" and record["command"][-1] == "OUT" and not record["float_folder_from_gguf"]
    with caplog.at_level("INFO"):
        assert peer_models.openvino_model_folder(source, "int4", tmp_path, converter) == folder
    assert len(calls) == 1 and "(cached)" in caplog.text
    int8 = peer_models.openvino_model_folder(source, "int8", tmp_path, converter)
    newer = peer_models.OpenVinoConverter(converter.python, {**CONVERTER_VERSIONS, "optimum-intel": "2.3.0"})
    converted_again = peer_models.openvino_model_folder(source, "int4", tmp_path, newer)
    assert len(calls) == 3 and int8 == folder.with_name("int8")
    assert calls[1][calls[1].index("--weight-format") + 1] == "int8"
    assert converted_again == tmp_path / sha / "openvino-2026.4.1-optimum-intel-2.3.0" / "int4"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["int4", "int4.convert.log", "int8", "int8.convert.log"]
    with pytest.raises(UserInputError, match=r"OpenVINO weights 'int3': expected one of int8, int4, fp32"):
        peer_models.openvino_model_folder(source, "int3", tmp_path, converter)


def test_an_interrupted_or_failed_openvino_conversion_leaves_no_model_to_use(tmp_path, monkeypatch):
    """Half a model in the staged folder, then Ctrl-C, or the converter's failure: nothing at the model's place, no
    staged or scratch folder left, and the next call converts again."""
    converter = peer_models.OpenVinoConverter(Path("/envs/ov/bin/python"), dict(CONVERTER_VERSIONS))
    source = ModelSource(str(DEMO_MODEL), DEMO_MODEL)
    folder = tmp_path / source.identity()["weights_sha256"] / converter.key / "int8"

    def interrupted(command, log):
        (Path(command[-1]) / "openvino_model.xml").write_text("<net")
        raise KeyboardInterrupt

    monkeypatch.setattr(peer_models, "run_logged", interrupted)
    with pytest.raises(KeyboardInterrupt):
        peer_models.openvino_model_folder(source, "int8", tmp_path, converter)
    assert not folder.exists() and not list(folder.parent.iterdir())
    calls = []
    monkeypatch.setattr(peer_models, "run_logged", fake_conversion(calls, code=1))
    with pytest.raises(UnsupportedModelError) as error:
        peer_models.openvino_model_folder(source, "int8", tmp_path, converter)
    message = str(error.value)
    assert "optimum-intel could not convert" in message and "with int8 weights (exit code 1" in message
    assert "boom" in message and str(folder.with_name("int8.convert.log")) in message
    assert "Leave openvino out of --peers" in message
    assert sorted(p.name for p in folder.parent.iterdir()) == ["int8.convert.log"]
    monkeypatch.setattr(peer_models, "run_logged", fake_conversion(calls))
    assert peer_models.openvino_model_folder(source, "int8", tmp_path, converter) == folder
    assert len(calls) == 2 and (folder / "conversion.json").is_file()


# --- the runner lifecycle and stopping rules (a fake peer) ------------------------------------------------


def test_runner_stops_at_the_stop_token_or_the_budget_and_reports_each_token():
    runner = CountingPeer(threads=2, max_seq_len=10, eos_token_ids=(102,))
    with pytest.raises(UserInputError, match="before load"):
        runner.generate([1], 4)
    seen = []
    with runner as loaded:
        out = loaded.generate([1, 2], 8, on_token=seen.append)
        assert out == peers.PeerOutput([100, 101, 102], 3, 2, 1) and seen == [100, 101, 102]  # the stop token kept
        assert loaded.generate([1, 2, 3, 4, 5, 6, 7, 8], 8).token_ids == [100, 101]  # max_seq_len 10, as ar stops
        with pytest.raises(UserInputError, match="fills the 10 positions"):
            loaded.generate(list(range(10)), 4)
        with pytest.raises(UserInputError, match="max_new_tokens >= 1"):
            loaded.generate([1], 0)
    assert runner.events == ["load", ("decode", 2, 8), ("decode", 8, 2), "close"]
    no_stop = CountingPeer(threads=1, max_seq_len=64).load()
    assert no_stop.generate([1], 5).token_ids == [100, 101, 102, 103, 104]
    with pytest.raises(UserInputError, match="threads must be >= 1"):
        CountingPeer(threads=0, max_seq_len=64)


def test_peer_mode_times_every_token_and_carries_the_speculation_counts():
    mode = peers.peer_mode("counting", CountingPeer(threads=1, max_seq_len=64).load(), {"peer": "counting"})
    sample = mode.run([1, 2], 5)
    assert mode.kind == "peer" and sample.token_ids == [100, 101, 102, 103, 104] and len(sample.timestamps) == 5
    assert (sample.lookup_proposed, sample.lookup_accepted, sample.rollbacks) == (3, 2, 1)


# --- a peer in a process of its own (tools/peer_process.py) -----------------------------------------------


def test_a_peer_in_its_own_process_decodes_times_and_refuses_as_in_this_one():
    from paradecode.tools.peer_process import PeerProcess

    runner = PeerProcess(CountingPeer, threads=1, max_seq_len=10, eos_token_ids=(102,))
    with pytest.raises(UserInputError, match="before load"):
        runner.timed([1], 4)
    with runner:
        child = runner._process
        timed = runner.timed([1, 2], 8)
        assert timed.output == peers.PeerOutput([100, 101, 102], 3, 2, 1)
        assert timed.started < timed.stamps[0] <= timed.stamps[1] <= timed.stamps[2]  # stamped in the child
        assert timed.peak_rss_mb is not None and timed.peak_rss_mb >= 0  # the child's own (Linux)
        with pytest.raises(UserInputError, match="fills the 10 positions"):  # the child's refusal, raised here
            runner.timed(list(range(10)), 4)
        seen = []
        assert runner.generate([1], 2, on_token=seen.append).token_ids == [100, 101] == seen
        assert child.is_alive() and child.pid != os.getpid()
    assert not child.is_alive() and child.exitcode == 0


def test_a_peer_that_crashes_is_reported_and_the_run_finishes_the_others(capsys):
    """A stand-in that kills its process with SIGSEGV, once in its warm-up and once in the middle of the run: each is
    left out, with its signal and the advice, and the other modes' samples are all there."""
    from paradecode.tools import bench_modes
    from paradecode.tools.peer_process import PeerProcess

    def ar(prompt_ids, max_new_tokens):
        return harness.Sample(token_ids=[100, 101, 102, 103][:max_new_tokens], tokens_per_second=10.0)

    common = {"threads": 1, "max_seq_len": 64}
    with ExitStack() as stack:
        runners = {
            "crashes at once": PeerProcess(CrashingPeer, crash_at=1, **common),
            "crashes later": PeerProcess(CrashingPeer, crash_at=3, **common),  # the warm-up, one run, then SIGSEGV
            "counting": PeerProcess(CountingPeer, **common),
        }
        modes = [harness.Mode("ar", "ar", ar)]
        modes += [peers.peer_mode(name, stack.enter_context(r), {}) for name, r in runners.items()]
        results = harness.measure(modes, [[1, 2], [3, 4]], max_new_tokens=4, repeat=2)
    for name in ("crashes at once", "crashes later"):
        assert "crashing crashed: its process was killed by SIGSEGV" in results.skipped[name], results.skipped
        assert "the benchmark goes on without it" in results.skipped[name] and not results.runs(name)
    assert "while decoding a 2-token prompt" in results.skipped["crashes at once"]
    assert len(results.runs("counting")) == len(results.runs("ar")) == 4
    assert results.matches("counting", "ar") == 4
    summary = bench_modes.summarize(results)
    assert "killed by SIGSEGV" in summary["crashes later"]["skipped"]
    assert "| crashes later | skipped: crashing crashed" in reporting.markdown_table(summary)


def test_a_llama_cpp_crash_names_the_build_that_avoids_it():
    from paradecode.tools.peer_process import crash_message

    message = crash_message("llama.cpp", -11, "decoding an 8-token prompt")
    assert message.startswith("llama.cpp crashed: its process was killed by SIGSEGV while decoding an 8-token prompt")
    assert "-DGGML_AMX_INT8=OFF" in message and "-DGGML_NATIVE=OFF" in message
    assert "ended (exit code 3) without an answer" in crash_message("ort-genai", 3, "loading")


# --- agreement with ar ------------------------------------------------------------------------------------


def test_common_prefix_share_counts_identical_leading_tokens_over_the_longer_output():
    share = harness.common_prefix_share
    assert share([1, 2, 3], [1, 2, 4, 5]) == 2 / 4
    assert share([1, 2, 3], [1, 2, 3]) == 1.0 and share([], []) == 1.0
    assert share([1, 2], [1, 2, 3, 4]) == 0.5  # stopping early is not full agreement
    assert share([9, 2, 3], [1, 2, 3]) == 0.0


def test_summary_and_table_report_identity_and_leading_agreement_with_ar():
    from paradecode.tools import bench_modes

    def mode(name, kind, tokens_of):
        def run(prompt_ids, max_new_tokens):
            return harness.Sample(token_ids=tokens_of(prompt_ids[0]), tokens_per_second=10.0)

        return harness.Mode(name, kind, run)

    modes = [
        mode("ar", "ar", lambda p: [1, 2, 3, 4]),
        mode("peer", "peer", lambda p: [1, 2, 3, 4] if p == 10 else [1, 2, 9, 9]),
    ]
    results = harness.measure(modes, [[10], [20]], max_new_tokens=4, repeat=2)
    assert results.leading_match("peer", "ar") == pytest.approx((1.0 + 0.5) / 2)
    assert results.identical_per_prompt("peer", "ar") == {"0": True, "1": False}
    assert results.leading_match("peer", None) is None
    summary = bench_modes.summarize(results)
    row = summary["peer"]
    assert row["kind"] == "peer" and row["exact_match_vs_ar"] == 0.5 and row["leading_match_vs_ar"] == 0.75
    assert row["identical_to_ar_per_prompt"] == {"0": True, "1": False}
    table = reporting.markdown_table(summary)
    assert "| match ar (leading) |" in table and "| 50% (75%) |" in table and "| 100% (100%) |" in table


def test_plot_draws_the_peers_as_reference_lines():
    summary = {
        "pd": {"kind": "paradecode", "settings": {"overlap": "batched"}, "speedup_vs_ar": spread(1.2)},
        "ort-genai int4 (2 threads)": {"kind": "peer", "settings": {}, "speedup_vs_ar": spread(3.0)},
    }
    figure = reporting.benchmark_figure(summary, "t")
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert "ort-genai int4 (2 threads)" in labels and "batched" in labels


def spread(median: float) -> dict[str, float]:
    return {"median": median, "min": median * 0.9, "max": median * 1.1}


# --- onnxruntime-genai, for real --------------------------------------------------------------------------


def transformers_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `ids`, every prompt token attended to (generate would otherwise mask the
    ones equal to its pad token, and the demo model's pad, BOS and EOS are all token 0)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def demo_genai(tmp_path_factory) -> Path:
    """onnxruntime-genai's fp32 model of the demo model (a real 9-layer Llama with a tokenizer)."""
    if (reason := genai_missing()) is not None:
        pytest.skip(reason)
    source = ModelSource(str(DEMO_MODEL), DEMO_MODEL)
    return peer_models.genai_model_folder(source, "fp32", tmp_path_factory.mktemp("peer-cache"))


@needs_genai
def test_genai_fp32_greedy_equals_transformers_generate(demo_genai):
    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 41, 99, 8, 1200, 7], [0, 9, 262, 275, 14, 341]]
    with (
        peers.OrtGenaiRunner(demo_genai, threads=2, max_seq_len=512) as plain,
        peers.OrtGenaiRunner(demo_genai, threads=2, max_seq_len=512, speculative=peers.NGRAM_OPTIONS) as ngram,
    ):
        for ids in prompts:
            expected = transformers_greedy(reference_model, ids, NEW_TOKENS)
            assert plain.generate(ids, NEW_TOKENS).token_ids == expected, ids
            out = ngram.generate(ids, NEW_TOKENS)
            assert out.token_ids == expected, ids  # n-gram speculation is lossless under greedy decoding
            assert out.proposed >= out.accepted >= 0
        assert any(ngram.generate(ids, NEW_TOKENS).proposed for ids in prompts), "the n-gram lookup never proposed"


@needs_genai
def test_genai_build_is_cached_and_recorded(demo_genai, caplog):
    record = json.loads((demo_genai / "build.json").read_text())
    assert record["precision"] == "fp32" and record["command"][1:3] == ["-m", peer_models.BUILDER]
    assert record["onnxruntime_genai"] == peer_models.genai_version() and not record["float_folder_from_gguf"]
    assert demo_genai.parts[-2:] == (f"ort-genai-{record['onnxruntime_genai']}", "fp32")
    cache = demo_genai.parents[2]
    with caplog.at_level("INFO"):
        again = peer_models.genai_model_folder(ModelSource(str(DEMO_MODEL), DEMO_MODEL), "fp32", cache)
    assert again == demo_genai and "(cached)" in caplog.text


def transformers_gguf(path: Path):
    """transformers' own loading of the GGUF file (dequantized to float32): the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf", reason="the gguf package is needed to write a GGUF file (paradecode[gguf])")
    path = tmp_path_factory.mktemp("peer-gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path)
    return path


PROMPT = [BOS_ID, 40, 41, 42, 60, 70, 33, 90, 100]


@pytest.mark.slow
@needs_genai
def test_genai_model_of_a_gguf_is_built_from_its_dequantized_float_model(tiny_gguf, tmp_path):
    from paradecode.export.source import resolve_model

    folder = peer_models.genai_model_folder(resolve_model(str(tiny_gguf)), "fp32", tmp_path)
    assert json.loads((folder / "build.json").read_text())["float_folder_from_gguf"] is True
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")], "scratch folders left behind"
    with peers.OrtGenaiRunner(folder, threads=2, max_seq_len=128) as runner:
        assert runner.generate(PROMPT, NEW_TOKENS).token_ids == transformers_greedy(
            transformers_gguf(tiny_gguf), PROMPT, NEW_TOKENS
        )


@pytest.mark.slow
@needs_genai
def test_bench_with_the_genai_peers_end_to_end(tiny_gguf, tmp_path, capsys, caplog):
    """A tiny GGUF exported, then benchmarked with --peers ort-genai: the peers' rows, in fp32, equal ar."""
    from paradecode.export import cli

    export = tmp_path / "export"
    assert cli.main([str(tiny_gguf), "-o", str(export), "--max-seq-len", "64", "--exit-layers", "1,2"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in (("the cat", "a"), ("at the", "b")))
    )
    capsys.readouterr()
    caplog.set_level("INFO")
    code, out = run_bench(
        [
            export,
            *("--prompts", prompts, "--max-new-tokens", 8, "--repeat", 1, "--thresholds", "default"),
            *("--overlaps", "batched", "--no-hf", "--peers", "ort-genai", "--peer-precision", "fp32"),
            *("--peer-cache", tmp_path / "cache", "--json", tmp_path / "b.json"),
        ],
        capsys,
    )
    assert code == 0, out
    assert "each uses" in caplog.text and "every core" in caplog.text
    data = json.loads((tmp_path / "b.json").read_text())
    names = [n for n, row in data["summary"].items() if not n.startswith("_") and row["kind"] == "peer"]
    assert [n.split(" (")[0] for n in names] == ["ort-genai fp32", "ort-genai-ngram fp32"], names
    for name in names:
        row = data["summary"][name]
        assert row["exact_match_vs_ar"] == 1.0 and row["leading_match_vs_ar"] == 1.0, (name, row)
        assert row["identical_to_ar_per_prompt"] == {"0": True, "1": True} and "speedup_vs_ar" in row
        assert row["settings"]["threads"] >= 1 and row["settings"]["precision"] == "fp32"
        for category in ("a", "b"):
            assert name in data["categories"][category]["summary"]
    assert f"| {names[0]} |" in out and "## a (1 prompt)" in out


# --- llama.cpp, for real (where llama-cpp-python is installed) -------------------------------------------


@needs_llama_cpp
def test_llama_cpp_decodes_greedily_from_a_fresh_context_every_call(tiny_gguf):
    """The runner's tokens are llama.cpp's own argmax chain (its logits, step by step) on every call, whatever
    came before. Against transformers only the first token is compared: llama.cpp multiplies Q8_0 weights with
    8-bit-quantized activations, so later tokens of random weights may part at near-ties."""
    import llama_cpp
    import numpy as np

    reference = llama_cpp.Llama(str(tiny_gguf), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    reference.reset()
    reference.eval(PROMPT)
    chain = []
    for _ in range(NEW_TOKENS):
        chain.append(int(np.argmax(reference.scores[reference.n_tokens - 1])))
        reference.eval([chain[-1]])
    reference.close()
    with peers.LlamaCppRunner(tiny_gguf, threads=2, max_seq_len=128) as runner:
        first = runner.generate(PROMPT, NEW_TOKENS).token_ids
        runner.generate([BOS_ID, 50, 51], 5)  # another prompt in between must leave nothing behind
        assert first == runner.generate(PROMPT, NEW_TOKENS).token_ids == chain
    assert first[0] == transformers_greedy(transformers_gguf(tiny_gguf), PROMPT, 1)[0]


# --- OpenVINO GenAI, for real (where openvino-genai and a Python with optimum-intel are here) ------------------

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}  # float32 arithmetic and KV cache
STORIES_PROMPTS = [[1, 403, 407, 261, 378, 395, 262, 1, 403, 407, 261], [1, 403, 407, 261, 378]]
STORIES_STORY = [378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]  # its greedy text
REPEATING = [1, *STORIES_STORY, *STORIES_STORY, *STORIES_STORY[:4]]  # a prompt that repeats itself: lookup finds it
OPENVINO_TOKENS = 16


def openvino_converter_for_tests() -> peer_models.OpenVinoConverter:
    """The Python PARADECODE_OPENVINO_CONVERTER names (refused, not skipped, where it is wrong), else this one where it
    has optimum-intel; skips without either."""
    configured = os.environ.get("PARADECODE_OPENVINO_CONVERTER")
    if configured:
        return peer_models.openvino_converter(configured)
    try:
        return peer_models.openvino_converter()
    except MissingDependencyError as err:
        pytest.skip(
            f"no Python with optimum-intel to convert models for OpenVINO: set PARADECODE_OPENVINO_CONVERTER ({err})"
        )


@pytest.fixture(scope="module")
def stories_openvino(stories_dir, tmp_path_factory) -> dict[str, Path]:
    """weights -> OpenVINO's model of stories260K (a real 5-layer Llama), converted by optimum-intel."""
    if peers.missing_packages(["openvino"]):
        pytest.skip("openvino-genai is not installed (not in the test extra: `pip install 'paradecode[peers]'`)")
    converter = openvino_converter_for_tests()
    source = ModelSource(str(stories_dir / "hf"), stories_dir / "hf")
    cache = tmp_path_factory.mktemp("openvino-cache")
    return {
        weights: peer_models.openvino_model_folder(source, weights, cache, converter) for weights in ("int8", "fp32")
    }


def stories_greedy(stories_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(stories_dir / "hf"), dtype=torch.float32).eval()
    return [transformers_greedy(model, ids, OPENVINO_TOKENS) for ids in prompts]


@pytest.mark.slow
@needs_openvino
def test_openvino_int8_greedy_equals_transformers_generate(stories_openvino, stories_dir):
    """As the benchmark runs it (int8 weights, the CPU plugin's own arithmetic: bf16 where the CPU has it), plain
    and with prompt lookup, OpenVINO's tokens equal transformers' float32 greedy ones on these prompts."""
    expected = stories_greedy(stories_dir, STORIES_PROMPTS)
    folder = stories_openvino["int8"]
    with (
        peers.OpenVinoRunner(folder, threads=2, max_seq_len=512) as plain,
        peers.OpenVinoRunner(folder, threads=2, max_seq_len=512, lookup=True) as lookup,
    ):
        for ids, tokens in zip(STORIES_PROMPTS, expected):
            assert plain.generate(ids, OPENVINO_TOKENS).token_ids == tokens, ids
            assert lookup.generate(ids, OPENVINO_TOKENS).token_ids == tokens, ids
    stop = expected[0][3]  # the stop token is kept and ends the output, as paradecode's decoding does
    with peers.OpenVinoRunner(folder, threads=2, max_seq_len=512, eos_token_ids=(stop,)) as stopping:
        assert stopping.generate(STORIES_PROMPTS[0], OPENVINO_TOKENS).token_ids == expected[0][:4]
    record = json.loads((folder / "conversion.json").read_text())
    assert record["weights"] == "int8" and set(record["converter"]) >= {"optimum-intel", "openvino", "nncf"}


@pytest.mark.slow
@needs_openvino
def test_openvino_lookup_is_lossless_and_fp32_weights_equal_transformers(stories_openvino, stories_dir):
    """On a prompt that repeats itself, in float32 arithmetic: fp32 weights give transformers' tokens, plain and with
    prompt lookup; int8 weights part from them after the first token (stories260K's margins are narrow: int8 rounding
    moves its argmax), and lookup still gives exactly what plain decoding gives."""
    (expected,) = stories_greedy(stories_dir, [REPEATING])
    outputs = {}
    for weights, folder in stories_openvino.items():
        for lookup in (False, True):
            with peers.OpenVinoRunner(folder, threads=2, max_seq_len=512, lookup=lookup, properties=F32) as runner:
                outputs[weights, lookup] = runner.generate(REPEATING, OPENVINO_TOKENS).token_ids
    assert outputs["fp32", False] == outputs["fp32", True] == expected
    assert outputs["int8", False] == outputs["int8", True]
    assert outputs["int8", False][0] == expected[0]
    share = harness.common_prefix_share(outputs["int8", False], expected)
    print(f"int8 weights in float32 arithmetic: {share:.0%} of transformers' leading tokens")


@pytest.mark.slow
@needs_openvino
def test_bench_with_the_openvino_peers_end_to_end(stories_openvino, stories_export, tmp_path, capsys):
    """stories260K's export benchmarked with --peers openvino (fp32 weights, converted by the fixture and found in the
    cache): both OpenVINO rows, with their settings, and their tokens equal ar's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The little dog")))
    converter = openvino_converter_for_tests()
    code, out = run_bench(
        [
            stories_export[0],
            *("--prompts", prompts, "--max-new-tokens", 8, "--repeat", 1, "--thresholds", "default"),
            *("--overlaps", "batched", "--no-hf", "--peers", "openvino", "--openvino-weights", "fp32"),
            *("--openvino-converter", converter.python, "--peer-cache", stories_openvino["fp32"].parents[2]),
            *("--json", tmp_path / "b.json"),
        ],
        capsys,
    )
    assert code == 0, out
    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    names = [n for n, row in summary.items() if not n.startswith("_") and row["kind"] == "peer"]
    assert [n.split(" (")[0] for n in names] == ["openvino fp32", "openvino-lookup fp32"], names
    for name in names:
        row = summary[name]
        assert row["settings"]["model"] == str(stories_openvino["fp32"]) and row["settings"]["weights"] == "fp32"
        assert row["settings"]["threads"] >= 1
        assert row["exact_match_vs_ar"] == 1.0, (name, row)
    assert summary[names[1]]["settings"]["lookup"] == peers.OPENVINO_LOOKUP_OPTIONS
