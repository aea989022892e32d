"""The TensorRT path: profile and cache-key logic everywhere; engine builds where TensorRT and a GPU exist."""

import pytest

from paradecode.export.tensorrt import ProfileSettings, profile_shapes
from paradecode.graphs.manifest import read_manifest


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


@pytest.mark.tensorrt
def test_tensorrt_engines_build_and_match_onnxruntime(model_dirs, tmp_path):
    """Builds an engine per subgraph and compares each with onnxruntime through polygraphy."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path / "trt"
    result = export_model(
        ExportConfig(
            model=str(model_dirs["llama"]), output=out, engine="tensorrt", max_seq_len=64, cache_dir=tmp_path / "cache"
        )
    )
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
            model=str(model_dirs["llama"]),
            output=tmp_path / "trt2",
            engine="tensorrt",
            max_seq_len=64,
            cache_dir=tmp_path / "cache",
        )
    )
    assert again.manifest.tensorrt == result.manifest.tensorrt
