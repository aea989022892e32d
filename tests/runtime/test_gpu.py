"""The GPU path: the torch backend on CUDA with and without CUDA graphs, CUDA-stream lanes, bf16.

Marked `gpu`: skipped, with the reason, where torch sees no CUDA device (tests/conftest.py).
"""

import itertools

import pytest

from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.runtime import NEVER, load
from tests.parity import assert_same_tokens, export_scorer
from tests.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.gpu
SETTINGS = list(itertools.product((0.0, 0.5, NEVER), ("streams", "batched", "both"), (1, 8)))


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_cuda_paradecode_equals_ar_equals_cpu(family, exports):
    folder, _ = exports[family]
    prompt = [3, 1, 4, 1, 5]
    cpu = load(folder, backend="torch")
    expected = cpu.generate(prompt_ids=prompt, max_new_tokens=40, mode="ar", ignore_eos=True).token_ids
    score = export_scorer(cpu)
    for graphs in (True, False):
        with load(folder, backend="torch", device="cuda", cuda_graphs=graphs) as gpu:
            ar = gpu.generate(prompt_ids=prompt, max_new_tokens=40, mode="ar", ignore_eos=True)
            what = f"{family} cuda ar (graphs={graphs}) vs cpu"
            assert_same_tokens(ar.token_ids, expected, what, prompt=prompt, score=score)
            for threshold, overlap, k in SETTINGS:
                ours = gpu.generate(
                    prompt_ids=prompt,
                    max_new_tokens=40,
                    thresholds=threshold,
                    overlap=overlap,
                    max_unverified=k,
                    ignore_eos=True,
                )
                what = f"{family} cuda graphs={graphs} {threshold}/{overlap}/K={k} vs ar"
                assert_same_tokens(ours.token_ids, ar.token_ids, what, prompt=prompt, score=score)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_bf16_export_on_cuda(family, model_dirs, tmp_path):
    out = tmp_path / "bf16"
    export_model(ExportConfig(model=str(model_dirs[family]), output=out, dtype="bfloat16", max_seq_len=64))
    with load(out, backend="torch", device="cuda") as gpu:
        ar = gpu.generate(prompt_ids=[2, 7, 1, 8], max_new_tokens=40, mode="ar", ignore_eos=True)
        for overlap in ("streams", "batched", "both"):
            ours = gpu.generate(
                prompt_ids=[2, 7, 1, 8], max_new_tokens=40, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            what = f"{family} bf16 {overlap} vs ar"
            assert_same_tokens(ours.token_ids, ar.token_ids, what, prompt=[2, 7, 1, 8], score=export_scorer(gpu))


def test_stories260k_golden_on_cuda(stories_dir, tmp_path):
    out = tmp_path / "stories"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=out))
    golden = (stories_dir / "golden_greedy_from_bos.txt").read_text().rstrip("\n")
    with load(out, backend="torch", device="cuda") as gpu:
        for overlap in ("streams", "batched", "both"):
            result = gpu.generate(prompt_ids=[1], max_new_tokens=260, overlap=overlap, thresholds=0.5, ignore_eos=True)
            assert result.text.startswith(golden), overlap


def test_onnxruntime_cuda_provider(exports):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed (CUDAExecutionProvider missing)")
    folder, _ = exports["mistral"]
    with load(folder, backend="onnxruntime", device="cuda") as gpu, load(folder) as cpu:
        expected = cpu.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, mode="ar", ignore_eos=True)
        ours = gpu.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, thresholds=0.0, overlap="streams", ignore_eos=True)
        what = "onnxruntime cuda vs cpu"
        assert_same_tokens(ours.token_ids, expected.token_ids, what, prompt=[1, 2, 3], score=export_scorer(cpu))
