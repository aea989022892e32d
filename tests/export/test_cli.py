"""paradecode-export's command line: every refusal exits 2 with a clear message and writes nothing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paradecode.export import cli
from paradecode.export.heads.file import save_heads
from paradecode.graphs.manifest import read_manifest


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_nothing_written(parent, name="out"):
    assert not (parent / name).exists()
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    assert not leftovers, f"staging folders left behind: {leftovers}"


def test_help_needs_no_heavy_imports():
    code = (
        "import sys; from paradecode.export import cli; "
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: cli.main(['--help'])\n"
        "    except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'transformers', 'tensorrt') if m in sys.modules]\n"
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_console_script_is_installed():
    # The script sits beside the interpreter running the tests; PATH need not include that folder.
    script = Path(sys.executable).parent / "paradecode-export"
    assert script.is_file(), f"console script not installed at {script}"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--exit-layers" in result.stdout


def test_folder_that_is_not_a_model(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    code, out = run([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2
    assert "no config.json" in out and "save_pretrained" in out
    assert_nothing_written(tmp_path)


def test_missing_path_that_is_not_a_hub_id(tmp_path, capsys):
    code, out = run([tmp_path / "nope" / "model", "-o", tmp_path / "out"], capsys)
    assert code == 2 and "neither an existing folder nor a Hugging Face Hub id" in out
    assert_nothing_written(tmp_path)


def test_unreachable_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = run(["no-such-org/no-such-model", "-o", tmp_path / "out"], capsys)
    assert code == 2 and "could not fetch 'no-such-org/no-such-model'" in out and "local folder" in out
    assert_nothing_written(tmp_path)


def test_model_without_weights(model_dirs, tmp_path, capsys):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(model_dirs["llama"] / "config.json", folder)
    code, out = run([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2 and "no weights" in out
    assert_nothing_written(tmp_path)


def test_unsupported_family(model_dirs, tmp_path, capsys):
    folder = tmp_path / "bert"
    shutil.copytree(model_dirs["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "bert"
    (folder / "config.json").write_text(json.dumps(config))
    code, out = run([folder, "-o", tmp_path / "out"], capsys)
    assert code == 2 and "'bert' is not supported" in out and "llama" in out and "gpt2" in out
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("layers", ["0", "4", "2,9"])
def test_exit_layer_out_of_range(model_dirs, tmp_path, capsys, layers):
    code, out = run([model_dirs["llama"], "-o", tmp_path / "out", "--exit-layers", layers], capsys)
    assert code == 2, out
    assert "1..3" in out  # the llama tiny model has 4 layers: exits sit after layers 1..3
    assert_nothing_written(tmp_path)


def test_exit_layers_that_are_not_numbers(model_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(model_dirs["llama"]), "-o", str(tmp_path / "out"), "--exit-layers", "two"])
    assert exit_.value.code == 2
    assert "comma-separated layer numbers" in capsys.readouterr().err
    assert_nothing_written(tmp_path)


def test_max_seq_len_above_the_models(model_dirs, tmp_path, capsys):
    code, out = run([model_dirs["gpt2"], "-o", tmp_path / "out", "--max-seq-len", "65"], capsys)
    assert code == 2 and "exceeds the model's max_position_embeddings (64" in out
    assert_nothing_written(tmp_path)


def test_unknown_dtype(model_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(model_dirs["llama"]), "-o", str(tmp_path / "out"), "--dtype", "float64"])
    assert exit_.value.code == 2
    assert "unknown dtype 'float64'" in capsys.readouterr().err
    assert_nothing_written(tmp_path)


def test_unsupported_opset(model_dirs, tmp_path, capsys):
    code, out = run([model_dirs["llama"], "-o", tmp_path / "out", "--opset", "17"], capsys)
    assert code == 2 and "TensorScatter" in out
    assert_nothing_written(tmp_path)


@pytest.mark.slow
def test_existing_output_needs_force(model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "16"], capsys)
    assert code == 2 and "--force" in message
    assert (out / "mine.txt").read_text() == "keep me"
    code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "16", "--force", "-q"], capsys)
    assert code == 0, message
    assert not (out / "mine.txt").exists() and read_manifest(out).max_seq_len == 16


def test_output_may_not_replace_the_model(model_dirs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dirs["gpt2"], model)
    code, out = run([model, "-o", model, "--force"], capsys)
    assert code == 2 and "would replace the model folder" in out
    assert (model / "config.json").is_file()


def test_heads_for_another_model_are_refused(model_dirs, tmp_path, capsys):
    import torch

    heads = save_heads(
        tmp_path / "heads.safetensors",
        {1: torch.eye(48)},
        {"base_model": "some/other-model", "base_weights_sha256": "0" * 64},
    )
    code, out = run([model_dirs["llama"], "-o", tmp_path / "out", "--heads", heads], capsys)
    assert code == 2 and "trained for another model" in out and "some/other-model" in out
    assert_nothing_written(tmp_path)


def test_tensorrt_without_tensorrt_exits_3_and_writes_nothing(model_dirs, tmp_path, capsys):
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401
        import torch

        if torch.cuda.is_available():
            pytest.skip("TensorRT and a GPU are present: the missing-TensorRT path cannot be reached here")
    except ImportError:
        pass
    code, out = run([model_dirs["llama"], "-o", tmp_path / "out", "--engine", "tensorrt"], capsys)
    assert code == 3
    assert "TensorRT" in out and "pip install" in out
    assert_nothing_written(tmp_path)


@pytest.mark.slow
def test_a_failed_validation_writes_nothing(model_dirs, tmp_path, capsys, monkeypatch):
    from paradecode.export import validate

    real = validate.check_onnxruntime

    def broken(path, module, io, cases, dtype, **options):
        check = real(path, module, io, cases, dtype, **options)
        if io.name == "layer_2":
            check.status, check.note = "FAIL", "simulated mismatch"
        return check

    monkeypatch.setattr(validate, "check_onnxruntime", broken)
    code, out = run([model_dirs["llama"], "-o", tmp_path / "deep" / "out", "--max-seq-len", "16"], capsys)
    assert code == 1 and "layer_2" in out and "simulated mismatch" in out and "nothing was written" in out
    assert not (tmp_path / "deep").exists(), "the parent folder the export created was left behind"


def test_an_interrupted_export_writes_nothing(model_dirs, tmp_path, capsys, monkeypatch):
    from paradecode.export import pipeline

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "save_weights", interrupt)
    code, out = run([model_dirs["llama"], "-o", tmp_path / "out", "--max-seq-len", "16"], capsys)
    assert code == 130 and "interrupted" in out
    assert_nothing_written(tmp_path)
