"""paradecode-export on tiny random models of every family and on the real stories260K.

Parity is checked against the real references: onnxruntime running each exported graph against
its PyTorch module, and the exported graphs chained by onnxruntime against Hugging Face's forward
and `generate(do_sample=False)`.
"""

import numpy as np
import pytest
import torch

from paradecode.export import validate
from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.graphs.manifest import read_manifest, verify_files
from paradecode.graphs.modules import build_subgraph
from paradecode.graphs.tensors import LOGITS
from tests.conftest import DRAFT_FEATURE_FAMILIES, EXPORT_SEQ_LEN
from tests.ort_chain import OrtChain
from tests.tiny_models import hf_greedy, tiny_model

LOGIT_TOLERANCE = 1e-4


def test_export_is_complete(family, exports):
    folder, result = exports[family]
    manifest = read_manifest(folder)
    spec = manifest.spec
    names = [s.io.name for s in manifest.subgraphs]
    expected = (
        ["embed"]
        + [f"layer_{i}" for i in range(1, spec.num_layers + 1)]
        + [f"exit_{e}" for e in manifest.exit_layers]
        + [f"layer_exit_{e}" for e in manifest.exit_layers]
        + ["final", "draft"]
        + (["draft_reduce"] if family in DRAFT_FEATURE_FAMILIES else [])  # its head reads three layers' outputs
    )
    assert sorted(names) == sorted(expected)
    assert manifest.draft["vocab"] == 2 * spec.vocab_size // 3 and manifest.draft["trained"] is False
    assert manifest.exit_layers and all(1 <= e < spec.num_layers for e in manifest.exit_layers)
    assert manifest.head_kind == "trained" and manifest.head_vocab == 2 * spec.vocab_size // 3
    for sub in manifest.subgraphs:
        assert (folder / sub.onnx).is_file()
    verify_files(folder, manifest)  # every file listed with its sha256
    assert all(c.status == "ok" for c in result.checklist.checks), result.checklist.lines()
    assert not list(folder.parent.glob(".*partial*")), "a staging folder was left behind"


def test_every_weight_is_stored_once(family, exports):
    """The graphs hold no weights of their own: every initializer of more than a few values is a reference
    into the one weights file, and the export is the size of that file plus a little."""
    import onnx

    folder, _ = exports[family]
    manifest = read_manifest(folder)
    weights_bytes = (folder / manifest.weights).stat().st_size
    for sub in manifest.subgraphs:
        graph = onnx.load(str(folder / sub.onnx), load_external_data=False).graph
        for init in graph.initializer:
            external = init.data_location == onnx.TensorProto.EXTERNAL
            values = int(np.prod(init.dims)) if init.dims else 1
            assert external or values <= 64, f"{sub.onnx}: {init.name} ({values} values) is a copy"
            if external:
                location = {e.key: e.value for e in init.external_data}["location"]
                assert (folder / "onnx" / location) == folder / manifest.weights
    graphs_bytes = sum((folder / s.onnx).stat().st_size for s in manifest.subgraphs)
    print(f"{family}: weights {weights_bytes} bytes, graphs {graphs_bytes} bytes")
    assert graphs_bytes < 200_000 * len(manifest.subgraphs)


def test_an_export_without_trained_heads_has_no_exit_graphs_and_never_exits_by_default(identity_exports):
    folder, result = identity_exports["llama"]
    manifest = read_manifest(folder)
    assert manifest.head_kind == "identity" and manifest.head_vocab is None
    assert not [s for s in manifest.subgraphs if s.io.kind in ("exit", "layer_exit")]
    assert manifest.exit_layers and all(t == float("inf") for t in manifest.thresholds.values())
    assert all(c.status == "ok" for c in result.checklist.checks), result.checklist.lines()


def test_each_subgraph_matches_its_module_in_onnxruntime(family, exports, model_dirs):
    """Fresh random inputs (not the exporter's own): decode (T=1) and batched (T=K+1) calls."""
    folder, _ = exports[family]
    manifest = read_manifest(folder)
    model = tiny_model(family)
    from paradecode.export.draft_head import draft_weights, load_draft_head
    from paradecode.export.families import family_for
    from paradecode.export.heads.file import load_heads
    from paradecode.export.pipeline import head_weights

    adapter = family_for(model.config.model_type)
    weights = adapter.weights(model, manifest.spec)
    transforms, _, vocab = load_heads(folder.parent / "heads.safetensors")
    weights.update(head_weights(manifest.spec, weights, transforms, vocab))
    draft, _ = load_draft_head(folder.parent / "draft.safetensors")
    weights.update(draft_weights(draft, weights.get("unembed.weight", weights["embed.tokens.weight"])))
    generator = torch.Generator().manual_seed(123)
    for sub in manifest.subgraphs:
        module = build_subgraph(manifest.spec, sub.io, weights, with_logits=True)
        session = validate.ort_session(folder / sub.onnx)
        for tokens in (1, manifest.max_unverified + 1):
            inputs = validate.random_inputs(
                sub.io,
                manifest.spec,
                max_seq_len=manifest.max_seq_len,
                max_batch=1,
                tokens=tokens,
                dtype=torch.float32,
                generator=generator,
            )
            expected = validate.run_torch(module, sub.io, inputs)
            actual = validate.run_ort(session, sub.io, inputs)
            check = validate.compare(sub.io.name, f"T={tokens}", expected, actual, validate.TOLERANCES["float32"])
            print(check.line())
            assert check.status == "ok", check.line()


def test_chained_graphs_reproduce_transformers(family, exports):
    """embed -> layers -> final with onnxruntime: HF logits for a prompt, then HF greedy token for token."""
    folder, _ = exports[family]
    model = tiny_model(family)
    chain = OrtChain(folder)
    prompt = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].numpy()
    ours = chain.run(prompt, 0)[LOGITS][0]
    difference = float(np.abs(ours - reference).max())
    print(f"{family}: prompt logits max |Δ| vs transformers = {difference:.2e} (tolerance {LOGIT_TOLERANCE})")
    assert difference < LOGIT_TOLERANCE

    new_tokens = EXPORT_SEQ_LEN - len(prompt) - 1  # decode beyond Mistral/Qwen2's sliding windows
    chain = OrtChain(folder)
    tokens, margins = chain.greedy(prompt, new_tokens)
    expected = hf_greedy(model, prompt, new_tokens)
    if tokens != expected:
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        pytest.fail(
            f"{family}: greedy differs from transformers at new token {first} "
            f"(ours {tokens[first]}, HF {expected[first]}, top-2 margin {margins[first]:.2e})"
        )


@pytest.mark.slow
def test_batched_export_runs_rows_at_different_positions(model_dirs, tmp_path):
    """max_batch 2: two rows at different positions and cache states match the module (qwen2: windows, bias)."""
    out = tmp_path / "batched"
    result = export_model(ExportConfig(model=str(model_dirs["qwen2"]), output=out, max_seq_len=32, max_batch=2))
    manifest = read_manifest(out)
    layer = manifest.subgraph("layer_3")
    assert layer.io.inputs[0].shape[0] == "batch"
    assert all(c.status == "ok" for c in result.checklist.checks), result.checklist.lines()
    from paradecode.export.families import family_for

    model = tiny_model("qwen2")
    weights = family_for("qwen2").weights(model, manifest.spec)
    module = build_subgraph(manifest.spec, layer.io, weights)
    inputs = validate.random_inputs(
        layer.io,
        manifest.spec,
        max_seq_len=32,
        max_batch=2,
        tokens=1,
        dtype=torch.float32,
        generator=torch.Generator().manual_seed(5),
    )
    assert inputs["positions"].shape == (2, 1) and inputs["positions"][0, 0] != inputs["positions"][1, 0]
    check = validate.compare(
        "layer_3",
        "batch 2",
        validate.run_torch(module, layer.io, inputs),
        validate.run_ort(validate.ort_session(out / layer.onnx), layer.io, inputs),
        validate.TOLERANCES["float32"],
    )
    assert check.status == "ok", check.line()


@pytest.mark.slow
def test_half_precision_exports(model_dirs, tmp_path):
    """float16 graphs validate in onnxruntime; bfloat16 graphs are written, and the CPU-provider gap is reported."""
    fp16 = export_model(
        ExportConfig(model=str(model_dirs["mistral"]), output=tmp_path / "fp16", dtype="float16", max_seq_len=32)
    )
    assert read_manifest(tmp_path / "fp16").subgraph("layer_1").io.inputs[0].dtype == "float16"
    assert all(c.status == "ok" for c in fp16.checklist.checks), fp16.checklist.lines()
    bf16 = export_model(
        ExportConfig(
            model=str(model_dirs["mistral"]),
            output=tmp_path / "bf16",
            dtype="bfloat16",
            max_seq_len=32,
            exit_layers=(1,),  # so layers 2-3 make a segment
        )
    )
    statuses = {c.subject: c.status for c in bf16.checklist.checks}
    assert statuses.pop("model") == "ok"  # the slicing check runs in float32 whatever the dtype
    skipped = [c for c in bf16.checklist.checks if c.status == "skip"]
    assert skipped and all("bfloat16" in c.note for c in skipped), bf16.checklist.lines()
    # segments too: their check against the layer graphs needs the kernels the CPU provider lacks
    assert any(c.subject.startswith("segment_") for c in skipped), bf16.checklist.lines()
    assert not bf16.checklist.failed
    import onnx

    graph = onnx.load(str(tmp_path / "bf16" / "onnx" / "layer_1.onnx"))
    onnx.checker.check_model(graph, full_check=True)
    assert graph.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


@pytest.mark.slow
def test_stories260k_export_and_greedy_parity(stories_dir, stories_export):
    """The real pretrained Llama: complete export, HF logits, HF greedy, and the published greedy text from BOS."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    out, result = stories_export
    manifest = read_manifest(out)
    assert manifest.with_logits
    assert manifest.max_seq_len == 512 and manifest.spec.num_layers == 5
    assert [s.io.name for s in manifest.subgraphs if s.io.kind == "layer"] == [f"layer_{i}" for i in range(1, 6)]
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "tokenizer" / "tokenizer.model").is_file()
    assert all(c.status == "ok" for c in result.checklist.checks), result.checklist.lines()

    model = AutoModelForCausalLM.from_pretrained(str(stories_dir / "hf")).eval()
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    prompt = tokenizer.encode("Once upon a time, there was a little dog").ids
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].numpy()
    ours = OrtChain(out).run(prompt, 0)[LOGITS][0]
    assert float(np.abs(ours - reference).max()) < LOGIT_TOLERANCE
    tokens, _ = OrtChain(out).greedy(prompt, 40)
    assert tokens == hf_greedy(model, prompt, 40)

    golden = (stories_dir / "golden_greedy_from_bos.txt").read_text().rstrip("\n")
    tokens, _ = OrtChain(out).greedy([1], 200)
    text = tokenizer.decode(tokens)
    assert text.startswith(golden[:400]), text[:200]
