"""The TensorRT path: profile and cache-key logic everywhere; engine builds where TensorRT and a GPU exist.

The engine tests carry the `tensorrt` marker and skip, with the reason, where TensorRT or a GPU is
missing (tests/conftest.py). They share one export of the tiny llama with engines (module fixture).
"""

import pytest
import torch

from paradecode.export import validate
from paradecode.export.tensorrt import ProfileSettings, profile_shapes
from paradecode.graphs.manifest import read_manifest
from paradecode.graphs.tensors import PAST_KEY, PAST_VALUE, POSITIONS, PRESENT_KEY, PRESENT_VALUE


def test_profiles_cover_decode_batched_and_prefill(exports):
    folder, _ = exports["llama"]
    manifest = read_manifest(folder)
    settings = ProfileSettings(max_batch=1, max_seq_len=manifest.max_seq_len, max_unverified=5)
    assert settings.token_ranges() == [(1, 1, 1), (2, 6, 6), (7, 64, 64)]
    shapes = profile_shapes(manifest.subgraph("layer_1").io, settings)
    assert shapes[0]["hidden"] == ((1, 1, 48), (1, 1, 48), (1, 1, 48))
    assert shapes[1]["positions"] == ((1, 2), (1, 6), (1, 6))
    assert shapes[2]["past_key"][2] == (1, 2, 64, 12)  # caches are fixed-size in every profile
    assert ProfileSettings(1, 4, 5).token_ranges() == [(1, 1, 1), (2, 4, 4)]


@pytest.fixture(scope="module")
def trt_export(model_dirs, tmp_path_factory):
    """(export folder, ExportResult, engine cache folder): the tiny llama exported with --engine tensorrt."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    folder = tmp_path_factory.mktemp("trt")
    config = ExportConfig(
        model=str(model_dirs["llama"]),
        output=folder / "export",
        engine="tensorrt",
        max_seq_len=64,
        cache_dir=folder / "cache",
    )
    return folder / "export", export_model(config), folder / "cache"


@pytest.mark.slow
@pytest.mark.tensorrt
def test_tensorrt_engines_build_and_match_onnxruntime(trt_export, model_dirs, tmp_path):
    """Builds an engine per subgraph and compares the final head's with onnxruntime through polygraphy."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out, result, cache = trt_export
    manifest = read_manifest(out)
    assert manifest.tensorrt is not None and all(s.engine for s in manifest.subgraphs)
    sub = manifest.subgraph("final")
    runners = [
        OnnxrtRunner(SessionFromOnnx(str(out / sub.onnx))),
        TrtRunner(EngineFromBytes((out / sub.engine).read_bytes())),
    ]
    accuracy = Comparator.compare_accuracy(Comparator.run(runners), compare_func=SimpleCompareFunc(atol=1e-3))
    assert bool(accuracy)
    # a second export reuses every cached engine
    again = export_model(
        ExportConfig(
            model=str(model_dirs["llama"]), output=tmp_path / "trt2", engine="tensorrt", max_seq_len=64, cache_dir=cache
        )
    )
    assert again.manifest.tensorrt == result.manifest.tensorrt


@pytest.mark.slow
@pytest.mark.tensorrt
@pytest.mark.parametrize("name", ["layer_1", "layer_4"])
def test_tensorrt_layer_engine_matches_its_module_and_writes_the_cache_in_place(trt_export, name):
    """A layer's engine, run by the tensorrt backend (`present_*` bound at the `past_*` addresses), against the
    PyTorch module on the same random inputs, at the edges of every optimization profile: `hidden_out` and the
    whole cache after the call (the T written slots, and every other slot left bit for bit as it was).

    Tolerance: the exporter's own float32 check (validate.TOLERANCES["float32"], the one it holds onnxruntime
    to; polygraphy builds with TF32 off); the largest difference is printed."""
    from paradecode.export.families import family_for
    from paradecode.graphs.modules import build_subgraph
    from paradecode.runtime.backends import backend_class
    from paradecode.runtime.loader import open_export
    from tests.tiny_models import tiny_model

    out, _, _ = trt_export
    manifest = read_manifest(out)
    sub = manifest.subgraph(name)
    model = tiny_model("llama")
    module = build_subgraph(manifest.spec, sub.io, family_for("llama").weights(model, manifest.spec))
    tolerance = validate.TOLERANCES["float32"]
    generator = torch.Generator().manual_seed(11)
    token_ranges = [tuple(r) for r in manifest.tensorrt["token_ranges"]]
    token_counts = sorted({t for lo, _, hi in token_ranges for t in (lo, hi)})
    assert token_counts[0] == 1 and token_counts[-1] == manifest.max_seq_len, token_ranges
    with backend_class("tensorrt")(open_export(out), device="cuda") as backend:
        for tokens in token_counts:
            inputs = validate.random_inputs(
                sub.io,
                manifest.spec,
                max_seq_len=manifest.max_seq_len,
                max_batch=1,
                tokens=tokens,
                dtype=torch.float32,
                generator=generator,
            )
            expected = validate.run_torch(module, sub.io, inputs)  # on copies: `inputs` keeps the caches before
            feeds = {k: v.to("cuda") for k, v in inputs.items()}
            key, value = feeds[PAST_KEY], feeds[PAST_VALUE]
            outputs = backend.run(name, feeds)
            torch.cuda.synchronize()
            what = f"{name} T={tokens}"
            assert outputs[PRESENT_KEY] is key and outputs[PRESENT_VALUE] is value, (
                f"{what}: the backend returned new cache tensors instead of the ones it was given"
            )
            actual = {k: v.cpu() for k, v in outputs.items()}
            check = validate.compare(name, f"TensorRT vs PyTorch, T={tokens}", expected, actual, tolerance)
            print(check.line())
            assert check.status == "ok", check.line()
            start = int(inputs[POSITIONS][0, 0])
            written = torch.zeros(manifest.max_seq_len, dtype=torch.bool)
            written[start : start + tokens] = True
            for cache, before in ((PRESENT_KEY, inputs[PAST_KEY]), (PRESENT_VALUE, inputs[PAST_VALUE])):
                after = actual[cache]
                assert torch.equal(after[:, :, ~written], before[:, :, ~written]), (
                    f"{what}: {cache} changed outside slots {start}..{start + tokens - 1}"
                )
                assert not torch.equal(after[:, :, written], before[:, :, written]), (
                    f"{what}: {cache} slots {start}..{start + tokens - 1} were not written in place"
                )
