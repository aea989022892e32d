"""Quantized exports: a GGUF file's own blocks kept bit for bit, int8/int4 from onnxruntime's quantizer, the form
the manifest records, and the errors around them.

Exactness is checked three ways for every kept GGUF block type: the repacked blocks dequantize to what
`gguf.quants.dequantize` gives (bit for bit); an export of a tiny GGUF of every family, with every type at
once (tests/conftest.py: MIXED_BLOCKS), stores each quantizable weight as blocks that dequantize bit for bit
to the weight transformers reads from the file; and its graphs reproduce PyTorch on those weights within
the stated tolerance (the export's own validation, which fails the export otherwise).
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file

from paradecode.export import cli
from paradecode.export.gguf_blocks import DECODERS, quantized_from_gguf
from paradecode.export.weight_storage import from_float
from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.manifest import read_manifest
from paradecode.graphs.quantization_manifest import Quantization, WeightFormat, canonical_shape
from paradecode.graphs.quantized_weights import QuantizedWeight, dequantized, pack, unpack
from tests.conftest import MIXED_BLOCKS
from tests.tiny_gguf import shape_for, write_tiny_gguf
from tests.tiny_models import TINY_CONFIGS

pytest.importorskip("gguf", reason="the gguf package is needed to write and read GGUF files (paradecode[gguf])")

BLOCK_TYPES = sorted(DECODERS)
LAYER_MATRICES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o"}


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(torch.float32).contiguous().view(torch.int32)


# --- the blockwise form -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits):
    values = torch.randint(0, 1 << bits, (3, 5, 32), dtype=torch.uint8)
    packed = pack(values, bits)
    assert packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack(packed, bits), values)


def test_four_bit_values_are_packed_low_nibble_first():
    """MatMulNBits' layout: value 2i in the low nibble of byte i, value 2i + 1 in its high nibble."""
    assert pack(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8), 4).tolist() == [[0x21, 0x43]]


def test_dequantize_is_scale_times_centred_values_plus_min():
    fmt = WeightFormat("test", 4, 16, (2, 20), "float32", zero_points=True, mins="float32")
    values = torch.arange(64, dtype=torch.uint8).reshape(2, 2, 16) % 16
    qw = QuantizedWeight(
        fmt,
        pack(values, 4),
        torch.tensor([[0.5, 2.0], [1.0, -1.0]]),
        pack(torch.tensor([[3, 5], [0, 15]], dtype=torch.uint8), 4),
        torch.tensor([[1.0, 0.0], [0.25, 10.0]]),
    )
    scale = torch.tensor([[0.5, 2.0], [1.0, -1.0]])[..., None]
    zero = torch.tensor([[3.0, 5.0], [0.0, 15.0]])[..., None]
    mins = torch.tensor([[1.0, 0.0], [0.25, 10.0]])[..., None]
    expected = (scale * (values.float() - zero) + mins).reshape(2, 32)[:, :20]  # K 20: the padded tail cut
    assert torch.equal(qw.dequantize(), expected)
    picked = qw.rows(torch.tensor([1]))
    assert picked.format.shape == (1, 20) and torch.equal(picked.dequantize(), expected[1:])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(bits=3), "bits 3"),
        (dict(block_size=24), "block_size 24"),
        (dict(shape=(4, 0)), "shape"),
        (dict(scales="bfloat16"), "scales 'bfloat16'"),
        (dict(mins="int8"), "mins 'int8'"),
    ],
)
def test_a_bad_format_is_refused(change, message):
    fields = dict(source="Q4_0", bits=4, block_size=32, shape=(4, 64), scales="float16", zero_points=False, mins=None)
    with pytest.raises(ValueError, match=message):
        WeightFormat(**{**fields, **change})


def test_stored_parts_must_fit_their_format():
    fmt = WeightFormat("Q4_0", 4, 32, (4, 64), "float16", zero_points=False, mins=None)
    good = {"w.qweight": torch.zeros(4, 2, 16, dtype=torch.uint8), "w.scales": torch.zeros(4, 2, dtype=torch.float16)}
    assert QuantizedWeight.from_stored("w", fmt, good).format == fmt
    with pytest.raises(ManifestError, match=r"lacks \['w.scales'\]"):
        QuantizedWeight.from_stored("w", fmt, {"w.qweight": good["w.qweight"]})
    with pytest.raises(ManifestError, match="scales is torch.float32 \\[4, 2\\]; its format says float16"):
        QuantizedWeight.from_stored("w", fmt, {**good, "w.scales": torch.zeros(4, 2)})


def test_quantization_names_only_quantizable_weights():
    fmt = WeightFormat("int8", 8, 32, (4, 64), "float32", zero_points=False, mins=None)
    with pytest.raises(ValueError, match=r"\['norm.weight'\] cannot be quantized"):
        Quantization("int8", {"norm.weight": fmt})
    with pytest.raises(
        ManifestError, match=r"quantization.activations is 'int4'; expected one of \['float', 'int8-heads', 'int8'\]"
    ):
        Quantization.from_dict({"activations": "int4", "weights": {}})
    record = Quantization("float", {"layers.1.attn.q.weight": fmt})
    assert Quantization.from_dict(json.loads(json.dumps(record.to_dict()))) == record


# --- GGUF blocks, bit for bit ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_each_block_type_dequantizes_bit_for_bit_as_gguf_does(block_type, tmp_path):
    """Every tensor of a tiny GGUF in `block_type`, repacked, dequantizes to gguf.quants.dequantize's values."""
    written = write_tiny_gguf(tmp_path / "tiny.gguf", block_types=block_type, tied=False)
    kept = 0
    for tensor in written.tensors.values():
        if tensor.tensor_type.name != block_type:
            continue
        rows, row_length = tensor.spec.shape
        ours = quantized_from_gguf(tensor.data, block_type, row_length)
        assert ours.format.source == block_type and ours.format.shape == (rows, row_length)
        expected = torch.from_numpy(np.ascontiguousarray(tensor.dequantize()))
        assert torch.equal(bits_of(ours.dequantize()), bits_of(expected)), f"{tensor.name} ({block_type})"
        kept += 1
    assert kept >= 7, f"only {kept} {block_type} tensors in the fixture"


def test_a_tensor_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="a Q4_0 tensor of rows of 64 values holds 36 bytes a row"):
        quantized_from_gguf(np.zeros((2, 35), dtype=np.uint8), "Q4_0", 64)


# --- exports of tiny GGUF files of every family -----------------------------------------------------------------


def canonical_weights(gguf_path):
    """The canonical float weights of transformers' own loading of the file (what the blocks must give)."""
    from paradecode.export.families import family_for
    from paradecode.export.gguf_file import model_from_gguf

    model = model_from_gguf(gguf_path, str(gguf_path))
    family = family_for(model.config.model_type)
    return family.weights(model, family.spec(model.config, model))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_a_gguf_export_keeps_every_block_bit_for_bit(family, quantized_exports):
    folder, result, gguf_path = quantized_exports[family, "gguf"]
    manifest = read_manifest(folder)
    quantization = manifest.quantization
    assert quantization is not None and quantization.activations == "float"  # the fixture's (tests/conftest.py)
    assert not result.checklist.failed
    floats = canonical_weights(gguf_path)
    quantizable = {name for name in floats if canonical_shape(manifest.spec, name, manifest.head_vocab)}
    assert quantizable <= set(quantization.weights), f"left float: {sorted(quantizable - set(quantization.weights))}"
    expected_sources = set(MIXED_BLOCKS.values())
    if family in ("gpt2", "phi3"):  # fused QKV, no gate of its own (gpt2: none; phi3: in ffn_up): no Q4_0, Q5_0, Q4_K
        expected_sources -= {"Q4_0", "Q5_0", "Q4_K"}
    assert set(quantization.sources()) == expected_sources
    stored = load_file(str(folder / manifest.weights))
    weights = dequantized(stored, quantization)
    for name, fmt in quantization.weights.items():
        if name == "exits.unembed":
            vocab = weights["exits.vocab"]
            assert torch.equal(bits_of(weights[name]), bits_of(floats["unembed.weight"][vocab])), name
            assert fmt.source == quantization.weights["unembed.weight"].source
            continue
        assert torch.equal(bits_of(weights[name]), bits_of(floats[name])), f"{family}: {name} ({fmt.source})"
        assert name not in stored, f"{name} is stored in float besides its blocks"


def run_cli(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue()


@pytest.mark.slow
def test_float_activations_reproduce_pytorch_on_the_dequantized_model(tmp_path):
    """--activations float: every graph within float32 rounding of PyTorch on the same (dequantized) weights,
    and plain decoding equal to transformers' greedy decoding of the GGUF file (its dequantized model)."""
    from paradecode.runtime import load
    from tests.parity import assert_same_tokens, hf_scorer

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, block_types=MIXED_BLOCKS, tied=False, seed=3)
    out = tmp_path / "export"
    code, printed = run_cli([gguf_path, "-o", out, "--max-seq-len", 64, "--activations", "float"])
    assert code == 0, printed
    assert "atol 1e-05·max|ref| rtol 0.001" in printed
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert len(set(expected)) > 4, expected
    for backend in ("onnxruntime", "torch"):
        with load(out, backend=backend) as model:
            assert model.manifest.quantization.activations == "float"
            ours = model.generate(prompt_ids=prompt, max_new_tokens=24, mode="ar", ignore_eos=True).token_ids
        assert_same_tokens(ours, expected, f"{backend} ar", prompt=prompt, score=hf_scorer(hf))


@pytest.mark.slow
def test_int8_heads_round_only_the_heads(tmp_path):
    """--activations int8-heads: the heads' quantized products (the final head's, the trained exit
    heads') take int8 activations (onnxruntime's accuracy_level 4), every layer's float ones (0), a fused layer_exit
    graph's too, and each graph is validated with its own kind's tolerance."""
    from tests.tiny_models import save_random_heads

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, block_types=MIXED_BLOCKS, tied=False, seed=4)
    heads = save_random_heads(gguf_path, tmp_path / "heads.safetensors")
    out = tmp_path / "export"
    args = ["--max-seq-len", 64, "--heads", heads, "--fused-exits", "--activations", "int8-heads"]
    code, printed = run_cli([gguf_path, "-o", out, *args])
    assert code == 0, printed
    manifest = read_manifest(out)
    assert manifest.quantization.activations == "int8-heads"
    levels: dict[str, set[int]] = {}
    for sub in manifest.subgraphs:
        graph = onnx.load(str(out / sub.onnx), load_external_data=False).graph
        levels.setdefault(sub.io.kind, set()).update(
            attr.i
            for node in graph.node
            if node.op_type == "MatMulNBits"
            for attr in node.attribute
            if attr.name == "accuracy_level"
        )
    assert levels["final"] == {4} and levels["exit"] == {4}, levels
    assert levels["layer"] == {0} and levels["layer_exit"] == {0}, levels
    assert all(found <= {0} for kind, found in levels.items() if kind not in ("final", "exit")), levels
    checks = {line.split("]")[1].split()[0]: line for line in printed.splitlines() if "onnxruntime vs PyTorch" in line}
    assert "|Δ|₂ <= 0.1·|ref|₂" in checks["final"], printed  # the int8 tolerance
    assert "atol 1e-05·max|ref| rtol 0.001" in checks["layer_1"], printed
    for kind, expected in {"final": "int8", "exit": "int8", "layer": "float", "segment": "float"}.items():
        assert Quantization("int8-heads", {}).activations_of(kind) == expected
        assert Quantization("float", {}).activations_of(kind) == "float"
        assert Quantization("int8", {}).activations_of(kind) == "int8"


# --- int8 / int4 from a float model ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_int_weights_are_onnxruntimes_own_blocks(bits):
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(bits))
    ours = from_float({"layers.1.mlp.up.weight": weight, "norm.weight": torch.ones(80)}, bits)
    assert set(ours) == {"layers.1.mlp.up.weight"}
    qw = ours["layers.1.mlp.up.weight"]
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=bits == 8, bits=bits)
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight.t().numpy().copy())
    assert np.array_equal(qw.qweight.numpy(), packed) and np.array_equal(qw.scales.numpy(), scales)
    assert (qw.zero_points is None) == (bits == 8)
    if bits == 4:
        assert np.array_equal(qw.zero_points.numpy(), zero_points)
    error = (qw.dequantize() - weight).abs().max() / weight.abs().max()
    assert error < (0.1 if bits == 4 else 0.01), float(error)  # K 80: three blocks, the last padded


@pytest.mark.slow
@pytest.mark.parametrize("source", ["int4", "int8"])
def test_an_int_export_records_and_stores_its_blocks(source, quantized_exports):
    folder, result, _ = quantized_exports["qwen2", source]
    manifest = read_manifest(folder)
    formats = manifest.quantization.weights
    assert {fmt.source for fmt in formats.values()} == {source}
    assert {"embed.tokens.weight", "unembed.weight", "exits.unembed"} <= set(formats)
    assert len(formats) == 3 + 7 * manifest.spec.num_layers
    assert all(fmt.zero_points == (source == "int4") and fmt.mins is None for fmt in formats.values())
    assert not result.checklist.failed


# --- bad input ------------------------------------------------------------------------------------------------


def test_int_weights_with_a_half_dtype_are_refused_before_any_work(tmp_path):
    code, printed = run_cli([tmp_path / "missing", "-o", tmp_path / "out", "--weights", "int4", "--dtype", "fp16"])
    assert code == 2
    assert "--weights int4 exports compute in float32" in printed and "pass --weights float" in printed
    assert not (tmp_path / "out").exists()


def test_an_unknown_weights_setting_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(tmp_path), "-o", str(tmp_path / "out"), "--weights", "int3"])
    assert exit_.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


def test_a_half_dtype_gguf_export_must_say_float(tmp_path):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, shape=shape_for("llama"), block_types="Q4_0")
    with pytest.raises(UserInputError, match="keeps the GGUF file's quantized blocks, which compute in float32"):
        export_model(ExportConfig(model=str(gguf_path), output=tmp_path / "out", dtype="float16"))
    assert not (tmp_path / "out").exists()


def first(record: dict) -> dict:
    return next(iter(record["weights"].values()))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q["weights"].update({"norm.weight": first(q)}), "cannot be quantized"),
        (lambda q: q["weights"].update({"layers.99.mlp.up.weight": first(q)}), "does not have"),
        (lambda q: first(q).update(shape=[3, 3]), "the spec gives"),
        (lambda q: first(q).update(bits=2), "bits 2"),
        (lambda q: q.update(activations="fp8"), "quantization.activations is 'fp8'"),
    ],
)
def test_a_tampered_quantization_record_is_refused(edit, message, quantized_exports, tmp_path):
    import shutil

    folder = tmp_path / "export"
    shutil.copytree(quantized_exports["llama", "int4"][0], folder)
    data = json.loads((folder / "manifest.json").read_text())
    edit(data["quantization"])
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        read_manifest(folder)


# --- the variant TensorRT builds from (no TensorRT here: run by onnxruntime, which reads the same ops) -----------


def matmul_and_gather_graph(n: int, k: int) -> onnx.ModelProto:
    """y = x @ W^T and rows = W[ids], W read from one initializer (as a traced Linear and embedding read it)."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("MatMul", ["x", "w_t"], ["y"]),
        helper.make_node("Gather", ["w", "ids"], ["rows"], axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, k]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, n]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, 3, k]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "Q8_0", "int4"])
def test_the_tensorrt_variant_computes_the_same_products(kind, tmp_path):
    """The symmetric INT4/INT8 DequantizeLinear form (plus the minima and zero points as a correction) gives
    x @ W^T for W the dequantized weight, and the embedding its rows."""
    import onnxruntime as ort

    from paradecode.export import quantized_products

    if kind == "int4":
        n, k = 24, 96
        weight = from_float({"layers.1.mlp.up.weight": torch.randn(n, k)}, 4)["layers.1.mlp.up.weight"]
    else:
        written = write_tiny_gguf(tmp_path / "t.gguf", block_types=kind, tied=False)
        tensor = next(t for t in written.tensors.values() if t.tensor_type.name == kind)
        k = tensor.spec.shape[1]
        n = min(24, tensor.spec.shape[0])
        weight = quantized_from_gguf(tensor.data, kind, k).rows(torch.arange(n))
    model = matmul_and_gather_graph(n, k)
    readers = {"w_t": ("w", True, weight.format), "w": ("w", False, weight.format)}
    quantized_products.rewrite(model.graph, readers, lambda name: None, "float", tensorrt={"w": weight})
    ops = {node.op_type for node in model.graph.node}
    assert "DequantizeLinear" in ops and not ops & {"MatMulNBits", "BitShift", "BitwiseAnd"}, ops
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 3, k)
    ids = torch.tensor([[0, 5, n - 1]])
    y, rows = session.run(None, {"x": x.numpy(), "ids": ids.numpy()})
    dense = weight.dequantize()
    assert torch.allclose(torch.from_numpy(y), x @ dense.t(), rtol=1e-4, atol=1e-4 * float(dense.abs().max()) * k)
    assert torch.equal(torch.from_numpy(rows), dense[ids])
