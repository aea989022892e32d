"""paradecode-export's command line: every refusal exits 2 with a clear message and writes nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paradecode.export import cli
from paradecode.export.heads.file import save_heads
from paradecode.graphs.errors import UserInputError
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
@pytest.mark.timeout(300)
def test_force_replaces_an_export_or_an_empty_folder_only(model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    for force in ([], ["--force"]):
        code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "16", *force], capsys)
        assert code == 2 and "is not a paradecode export" in message and "nothing else is deleted" in message
        assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "16"], capsys)
    assert code == 2 and "already exists. Pass --force to replace it" in message
    code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "16", "--force", "-q"], capsys)
    assert code == 0, message
    assert read_manifest(out).max_seq_len == 16
    code, message = run([model_dirs["gpt2"], "-o", out, "--max-seq-len", "8", "--force", "-q"], capsys)
    assert code == 0, message
    assert read_manifest(out).max_seq_len == 8 and [p.name for p in tmp_path.iterdir()] == ["out"]


# --- -o paths that cannot be published, or whose replacing would delete what is not an export ---------------------


def refuse_model_work(monkeypatch):
    """Each refusal comes before any work on the model."""
    from paradecode.export import pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("the model was touched before -o was checked")

    monkeypatch.setattr(pipeline, "resolve_model", too_late)
    monkeypatch.setattr(pipeline, "load_hf_model", too_late)


def link(tmp, name, target):
    (tmp / name).symlink_to(target)
    return tmp / name


def folder_with(tmp, name, files):
    (tmp / name).mkdir()
    for file, text in files.items():
        (tmp / name / file).write_text(text)
    return tmp / name


def inside(tmp, name, monkeypatch, files=None):
    """A folder `name` holding `files`, made the current folder."""
    folder = folder_with(tmp, name, files or {"keep.txt": "mine"})
    monkeypatch.chdir(folder)
    return folder


# (what -o is, made in a scratch folder: (tmp, monkeypatch) -> the -o argument), --force, what the message says
OUTPUT_PATHS = [
    pytest.param(lambda t, m: link(t, "out", t / "nowhere"), True, "which does not exist", id="dangling-symlink"),
    pytest.param(lambda t, m: link(t, "d", t / "nowhere") / "out", False, "which does not exist", id="under-dangling"),
    pytest.param(lambda t, m: link(t, "out", "out"), True, "which loops back on itself", id="symlink-loop"),
    pytest.param(lambda t, m: link(t, "l", "l") / "out", False, "which loops back on itself", id="under-a-loop"),
    pytest.param(
        lambda t, m: link(t, "out", folder_with(t, "real", {})),
        True,
        "is a symbolic link (to ",
        id="symlink-to-a-folder",
    ),
    pytest.param(lambda t, m: t / os.fsdecode(b"bad\xff"), False, "is not valid UTF-8 text", id="non-utf8-name"),
    pytest.param(lambda t, m: inside(t, "work", m) and Path("."), True, "is the current folder", id="dot"),
    pytest.param(lambda t, m: inside(t, "work", m) and Path(".."), True, "is a parent of the current folder", id="up"),
    pytest.param(lambda t, m: Path("/"), True, "is the root folder (/)", id="root"),
    pytest.param(
        lambda t, m: m.setenv("HOME", str(folder_with(t, "home", {"keep.txt": "mine"}))) or t / "home",
        True,
        "is your home folder",
        id="home",
    ),
    pytest.param(
        lambda t, m: folder_with(t, "out", {"keep.txt": "mine"}),
        True,
        "exists and is not a paradecode export",
        id="not-an-export",
    ),
    pytest.param(
        lambda t, m: folder_with(t, "out", {"manifest.json": '{"name": "a web app"}'}),
        True,
        "exists and is not a paradecode export",
        id="another-manifest",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("make", "force", "message"), OUTPUT_PATHS)
def test_output_paths_that_cannot_be_published_are_refused_and_nothing_is_touched(
    model_dirs, tmp_path, monkeypatch, capsys, make, force, message
):
    model = model_dirs["gpt2"]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    refuse_model_work(monkeypatch)
    output = make(scratch, monkeypatch)
    before = sorted(str(p) for p in scratch.rglob("*"))
    code, out = run([model, "-o", output, *(["--force"] if force else [])], capsys)
    assert code == 2, out
    assert "paradecode-export: error: " in out and message in out and "Traceback" not in out, out
    assert "-o" in out, "the message names the option to change"
    assert sorted(str(p) for p in scratch.rglob("*")) == before, "something was created or deleted"
    assert all(p.read_text() == "mine" for p in scratch.rglob("keep.txt"))


@pytest.fixture
def unchangeable_folder(tmp_path):
    """An empty folder nothing can be created in or moved out of: immutable (chattr +i, which root cannot
    bypass), else read-only by its mode (which only root bypasses)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    immutable = shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if not (immutable and immutable.returncode == 0):
        immutable = None
        folder.chmod(0o555)
        if os.access(folder, os.W_OK):
            folder.chmod(0o755)
            pytest.skip("chattr +i is not permitted here and this process bypasses file modes (root)")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.mark.timeout(60)
def test_an_unchangeable_output_folder_is_refused_before_any_work(model_dirs, unchangeable_folder, monkeypatch, capsys):
    """--force on a folder that cannot be moved aside failed with a traceback after the whole export."""
    refuse_model_work(monkeypatch)
    code, out = run([model_dirs["gpt2"], "-o", unchangeable_folder, "--force"], capsys)
    assert code == 2, out
    assert f"cannot replace the output folder {unchangeable_folder}: {unchangeable_folder} cannot be changed" in out
    assert "choose another -o path" in out and "Traceback" not in out
    assert unchangeable_folder.is_dir() and list(unchangeable_folder.iterdir()) == []


@pytest.mark.timeout(30)
def test_a_folder_that_appears_during_the_export_is_not_replaced(tmp_path):
    """--force was checked against the folder at the start; what appears at the end is checked again."""
    from paradecode.export.files import replaceable, staged_folder

    out = tmp_path / "out"
    with (
        pytest.raises(UserInputError, match="neither a paradecode export nor an empty folder"),
        staged_folder(out, force=True, may_replace=replaceable) as folder,
    ):
        (folder / "manifest.json").write_text("{}")
        folder_with(tmp_path, "out", {"keep.txt": "mine"})
    assert (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "the staged folder was left behind"


def test_output_may_not_replace_the_model(model_dirs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dirs["gpt2"], model)
    code, out = run([model, "-o", model, "--force"], capsys)
    assert code == 2 and "is not a paradecode export" in out
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
