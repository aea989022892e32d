"""The GPU path: the torch backend on CUDA with and without CUDA graphs, CUDA-stream lanes, bf16.

Marked `gpu`: skipped, with the reason, where torch sees no CUDA device (tests/conftest.py). Every
ParaDecode setting (tests/parity.py: SETTINGS) is a test of its own; each model is loaded once per
module, on the CPU (the reference) and on CUDA per CUDA-graphs choice.
"""

import pytest

from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.runtime import load
from tests.conftest import Cache
from tests.parity import OVERLAPS, SETTINGS, assert_same_tokens, export_scorer
from tests.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.gpu
PROMPT = [3, 1, 4, 1, 5]
NEW_TOKENS = 40
GRAPHS = {"cuda-graphs": True, "no-cuda-graphs": False}


@pytest.fixture(scope="module")
def cpu_ar(loaded) -> Cache:
    """family -> (the CPU torch model, its ar decoding of PROMPT): the reference of the CUDA runs."""

    def build(family):
        cpu = loaded[family, "torch"]
        return cpu, cpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids

    return Cache(build)


@pytest.fixture(scope="module")
def cuda_models(exports):
    """(family, CUDA graphs?) -> the export loaded with the torch backend on CUDA, closed when the module ends."""
    models = Cache(lambda key: load(exports[key[0]][0], backend="torch", device="cuda", cuda_graphs=key[1]))
    yield models
    for model in models.values():
        model.close()


@pytest.fixture(scope="module")
def cuda_ar(cuda_models) -> Cache:
    """(family, CUDA graphs?) -> the CUDA model's own ar decoding of PROMPT."""
    return Cache(
        lambda key: (
            cuda_models[key]
            .generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True)
            .token_ids
        )
    )


@pytest.mark.parametrize("graphs", list(GRAPHS.values()), ids=list(GRAPHS))
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_cuda_ar_equals_cpu(family, graphs, cpu_ar, cuda_ar):
    cpu, expected = cpu_ar[family]
    what = f"{family} cuda ar (graphs={graphs}) vs cpu"
    assert_same_tokens(cuda_ar[family, graphs], expected, what, prompt=PROMPT, score=export_scorer(cpu))


@pytest.mark.parametrize(("threshold", "overlap", "k"), SETTINGS)
@pytest.mark.parametrize("graphs", list(GRAPHS.values()), ids=list(GRAPHS))
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_cuda_paradecode_equals_ar(family, graphs, threshold, overlap, k, cpu_ar, cuda_models, cuda_ar):
    cpu, _ = cpu_ar[family]
    ours = cuda_models[family, graphs].generate(
        prompt_ids=PROMPT,
        max_new_tokens=NEW_TOKENS,
        thresholds=threshold,
        overlap=overlap,
        max_unverified=k,
        ignore_eos=True,
    )
    what = f"{family} cuda graphs={graphs} {threshold}/{overlap}/K={k} vs ar"
    assert_same_tokens(ours.token_ids, cuda_ar[family, graphs], what, prompt=PROMPT, score=export_scorer(cpu))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_bf16_export_on_cuda(family, model_dirs, tmp_path):
    """Its own export: the shared ones are float32."""
    out = tmp_path / "bf16"
    export_model(ExportConfig(model=str(model_dirs[family]), output=out, dtype="bfloat16", max_seq_len=64))
    with load(out, backend="torch", device="cuda") as gpu:
        ar = gpu.generate(prompt_ids=[2, 7, 1, 8], max_new_tokens=40, mode="ar", ignore_eos=True)
        for overlap in OVERLAPS:
            ours = gpu.generate(
                prompt_ids=[2, 7, 1, 8], max_new_tokens=40, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            what = f"{family} bf16 {overlap} vs ar"
            assert_same_tokens(ours.token_ids, ar.token_ids, what, prompt=[2, 7, 1, 8], score=export_scorer(gpu))


@pytest.mark.slow
def test_stories260k_golden_on_cuda(stories_dir, stories_export):
    golden = (stories_dir / "golden_greedy_from_bos.txt").read_text().rstrip("\n")
    with load(stories_export[0], backend="torch", device="cuda") as gpu:
        for overlap in OVERLAPS:
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


@pytest.mark.parametrize("source", ["gguf", "int4"])
def test_quantized_export_on_cuda(source, quantized_exports):
    """A quantized export (a GGUF's own blocks; onnxruntime's int4) on CUDA: the torch backend dequantizes its
    weights on load, so CUDA ar must equal the CPU torch reference, and ParaDecode (segments, every overlap,
    CUDA graphs on) must equal CUDA ar."""
    folder, _, _ = quantized_exports["llama", source]
    with load(folder, backend="torch") as cpu, load(folder, backend="torch", device="cuda") as gpu:
        expected = cpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        ar = gpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        score = export_scorer(cpu)
        assert_same_tokens(ar, expected, f"{source} cuda ar vs cpu", prompt=PROMPT, score=score)
        for overlap in OVERLAPS:
            ours = gpu.generate(
                prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            assert_same_tokens(ours.token_ids, ar, f"{source} cuda {overlap} vs ar", prompt=PROMPT, score=score)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compiled_modules_on_cuda(family, cpu_ar, exports):
    """torch.compile'd modules (`torch_compile=True`) captured as CUDA graphs: CUDA ar must equal the CPU torch
    reference, and ParaDecode (every overlap, every token exiting) the compiled model's own ar."""
    cpu, expected = cpu_ar[family]
    score = export_scorer(cpu)
    with load(exports[family][0], backend="torch", device="cuda", torch_compile=True) as gpu:
        ar = gpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        assert_same_tokens(ar, expected, f"{family} compiled cuda ar vs cpu", prompt=PROMPT, score=score)
        for overlap in OVERLAPS:
            ours = gpu.generate(
                prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            what = f"{family} compiled cuda {overlap} vs ar"
            assert_same_tokens(ours.token_ids, ar, what, prompt=PROMPT, score=score)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("source", ["gguf", "int4"])
def test_int4_kernels_on_cuda(source, compiled, quantized_exports):
    """A quantized export's 4-bit weights read by torch's CUDA int4 kernel (`int4_kernels=True`,
    runtime/backends/int4_kernels.py): they are used, plain decoding stays the CPU reference's greedy decoding up
    to near ties (the kernel computes in bfloat16), the backend's row form is probed, and ParaDecode (every token
    exiting, every overlap, CUDA graphs) gives exactly plain decoding's tokens on them."""
    folder, _, _ = quantized_exports["llama", source]
    options = {"device": "cuda", "torch_compile": compiled, "int4_kernels": True}
    with load(folder, backend="torch") as cpu, load(folder, backend="torch", **options) as gpu:
        assert gpu.backend.int4.replaced and gpu.backend.probes_rows
        print(f"{source} int4 cuda, compiled {compiled}: row form {gpu.backend.row_form}")
        assert gpu.backend.row_form is not None, "no row form keeps a position's bits with int4 kernels on CUDA"
        expected = cpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        ar = gpu.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        assert_same_tokens(ar, expected, f"{source} int4 cuda ar vs cpu", prompt=PROMPT, score=export_scorer(cpu))
        for overlap in OVERLAPS:
            ours = gpu.generate(
                prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            assert ours.token_ids == ar, f"{source} int4 cuda {overlap}: {ours.token_ids} against ar's {ar}"
