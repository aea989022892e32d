"""Runtime error paths: clear messages, no hang, and a loaded model survives every bad request."""

import json
import shutil
import sys

import pytest

from paradecode.graphs.errors import ManifestError, MissingDependencyError, ModelClosedError, UserInputError
from paradecode.runtime import NEVER, GenerationConfig, cli, load
from paradecode.runtime.backends import backend_class


@pytest.fixture
def model(exports):
    folder, _ = exports["llama"]
    with load(folder) as loaded:
        yield loaded


def still_works(model) -> None:
    result = model.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, thresholds=0.0, ignore_eos=True)
    assert len(result.token_ids) == 8


def test_prompt_longer_than_the_cache(model):
    with pytest.raises(
        UserInputError, match=r"65 tokens, more than the export's KV cache holds \(64 positions.*--max-seq-len"
    ):
        model.generate(prompt_ids=[1] * 65, max_new_tokens=4)
    still_works(model)


def test_max_new_tokens_beyond_the_cache_stops_cleanly(model, caplog):
    for mode in ("ar", "paradecode"):
        result = model.generate(prompt_ids=[1] * 60, max_new_tokens=50, mode=mode, thresholds=0.0, ignore_eos=True)
        assert len(result.token_ids) == 5  # positions 59..63 each give one token: 64 - 60 + 1
        assert result.stats.stop_reason == "max_seq_len"
    assert "KV cache is full" in caplog.text
    still_works(model)


def test_empty_prompt_and_bad_ids(model):
    with pytest.raises(UserInputError, match="empty"):
        model.generate(prompt_ids=[], max_new_tokens=4)
    with pytest.raises(UserInputError, match="outside the vocabulary"):
        model.generate(prompt_ids=[1, 10_000], max_new_tokens=4)
    with pytest.raises(UserInputError, match="exactly one of a text prompt, prompt ids or chat messages; got none"):
        model.generate(max_new_tokens=4)
    with pytest.raises(UserInputError, match="no tokenizer"):
        model.generate("hello", max_new_tokens=4)
    still_works(model)


def test_stop_strings_need_a_tokenizer(model):
    """Refused, not silently ignored: without a tokenizer the output cannot be read as text."""
    with pytest.raises(UserInputError, match=r"stop strings \['x'\] need the export's tokenizer"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=4, stop="x")
    still_works(model)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_threshold_outside_the_unit_interval(model, threshold):
    with pytest.raises(UserInputError, match=r"outside \[0, 1\].*never"):
        model.generate(prompt_ids=[1], max_new_tokens=4, thresholds=threshold)
    still_works(model)


def test_never_and_per_layer_thresholds_are_accepted(model):
    assert GenerationConfig(thresholds=NEVER).thresholds == NEVER
    layers = model.manifest.exit_layers
    result = model.generate(prompt_ids=[1], max_new_tokens=6, thresholds={layers[0]: 0.0}, ignore_eos=True)
    assert set(result.stats.exits_per_layer) == {layers[0]}, result.stats  # threshold 0 there: every token may exit
    with pytest.raises(UserInputError, match="exit layers are"):
        model.generate(prompt_ids=[1], max_new_tokens=6, thresholds={99: 0.5})


def test_other_bad_settings():
    for settings, message in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(mode="beam"), "mode"),
        (dict(overlap="sideways"), "overlap"),
        (dict(max_unverified=0), "max_unverified"),
    ]:
        with pytest.raises(UserInputError, match=message):
            GenerationConfig(**settings)


@pytest.mark.timeout(120)  # a regression here hangs rather than fails
def test_a_failing_side_lane_raises_instead_of_hanging(model, monkeypatch):
    real = model.backend.run

    def flaky(name, feeds, lane="main", outputs=None):
        if lane != "main":
            raise RuntimeError("device lost")
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(model.backend, "run", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=30, thresholds=0.0, overlap="streams", ignore_eos=True)
    monkeypatch.setattr(model.backend, "run", real)
    still_works(model)


def copy_export(exports, tmp_path):
    folder, _ = exports["llama"]
    copy = tmp_path / "export"
    shutil.copytree(folder, copy)
    return copy


def test_incompatible_manifest_version(exports, tmp_path):
    copy = copy_export(exports, tmp_path)
    data = json.loads((copy / "manifest.json").read_text())
    data["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="format version 99.*paradecode-export"):
        load(copy)


def test_missing_and_corrupt_files_are_named(exports, tmp_path):
    copy = copy_export(exports, tmp_path)
    (copy / "onnx" / "exit_2.onnx").unlink()
    with pytest.raises(ManifestError, match="exit_2.onnx"):
        load(copy)
    copy = copy_export(exports, tmp_path / "second")
    with open(copy / "onnx" / "weights.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(ManifestError, match="weights.safetensors is corrupt: sha256"):
        load(copy, backend="torch")


def test_not_an_export(tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json.*paradecode-export"):
        load(tmp_path)
    with pytest.raises(UserInputError, match="not a folder"):
        load(tmp_path / "missing")


def test_backend_that_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if onnxruntime were not installed
    monkeypatch.delitem(sys.modules, "paradecode.runtime.backends.onnxruntime_backend", raising=False)
    with pytest.raises(MissingDependencyError, match=r"onnxruntime backend is not installed.*paradecode\[cpu\]"):
        backend_class("onnxruntime")


def test_tensorrt_backend_without_tensorrt_or_engines(exports):
    folder, _ = exports["llama"]
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="tensorrt backend is not installed.*pypi.nvidia.com"):
            load(folder, backend="tensorrt", device="cuda")
        return
    with pytest.raises((ManifestError, UserInputError)):
        load(folder, backend="tensorrt", device="cuda")  # this export has no engines


def test_unknown_backend(exports):
    folder, _ = exports["llama"]
    with pytest.raises(UserInputError, match="backend 'tvm'"):
        load(folder, backend="tvm")


def test_cuda_without_a_gpu(exports):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU error cannot be reached")
    folder, _ = exports["llama"]
    with pytest.raises((UserInputError, MissingDependencyError), match="cuda"):
        load(folder, backend="torch", device="cuda")


@pytest.mark.timeout(60)  # the bug this guards against was a hang in close()
def test_closing_the_model_stops_an_open_stream(exports):
    folder, _ = exports["llama"]
    model = load(folder)
    stream = model.stream(prompt_ids=[1, 2, 3], max_new_tokens=40, thresholds=0.0, overlap="streams", ignore_eos=True)
    iterator = iter(stream)
    first = [next(iterator).token, next(iterator).token]  # the side lanes are working now
    model.close()
    assert model.closed
    assert list(iterator) == [], "the stream went on after the model was closed"
    result = stream.result
    assert result is not None, "the closed stream left no result"
    assert result.stats.stop_reason == "closed", result.stats
    assert result.token_ids == first and result.stats.new_tokens == 2
    with pytest.raises(ModelClosedError, match="closed"):
        model.generate(prompt_ids=[1], max_new_tokens=2)
    with pytest.raises(ModelClosedError, match="closed"):
        model.stream(prompt_ids=[1], max_new_tokens=2)
    model.close()  # idempotent


def test_a_second_call_while_this_threads_stream_is_open_decodes_beside_it(model):
    """Each call has an engine (a KV cache) of its own: a call made while the thread's stream is open neither waits
    for it nor disturbs it."""
    settings = dict(max_new_tokens=20, ignore_eos=True)
    whole, short = (model.generate(prompt_ids=p, **settings).token_ids for p in ([1, 2, 3], [1]))
    stream = model.stream(prompt_ids=[1, 2, 3], **settings)
    first = next(iter(stream))
    assert model.generate(prompt_ids=[1], **settings).token_ids == short
    assert [first.token, *(piece.token for piece in stream)] == whole
    still_works(model)
    with model.stream(prompt_ids=[1, 2], max_new_tokens=20, ignore_eos=True) as early:
        next(iter(early))
    still_works(model)


def test_bindings_follow_the_cache_they_are_given(exports):
    import torch

    folder, _ = exports["llama"]
    with load(folder) as model:
        backend = model.backend
        first, second = backend.allocate_cache(), backend.allocate_cache()
        hidden = torch.randn(1, 1, model.manifest.spec.hidden_size)
        for cache in (first, second):
            key, value = cache.layer(1)
            out = backend.run(
                "layer_1", {"hidden": hidden, "positions": torch.tensor([[0]]), "past_key": key, "past_value": value}
            )
            assert out["present_key"] is key and out["present_value"] is value
        assert torch.count_nonzero(second.keys[0]) > 0, "the second cache was not written"


SEEDS = "an integer from -9223372036854775808 to 18446744073709551615 (-2**63 to 2**64 - 1, the seeds paradecode-serve"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [str(2**64), str(2**80), str(-(2**63) - 1), "1e3"])
def test_generate_refuses_a_seed_the_server_refuses(exports, capsys, seed):
    folder, _ = exports["llama"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            [str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--temperature", "0.8", f"--seed={seed}"]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seed: expected {SEEDS}" in err and seed in err, err


@pytest.mark.timeout(60)
def test_generate_wraps_a_negative_seed_as_the_server_does(exports, capsys):
    """-1 is 2**64 - 1 (two's complement), in paradecode-serve's requests and here."""
    folder, _ = exports["llama"]
    outputs = []
    for seed in ("-1", str(2**64 - 1)):
        argv = [str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--temperature", "0.8", "--json"]
        assert cli.main([*argv, f"--seed={seed}"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[0]["stats"]["seed"] == outputs[1]["stats"]["seed"] == 2**64 - 1
