"""The tiny GGUF fixtures (tests/tiny_gguf): for every registered family and block type, transformers
loads the file with no missing key and reads back exactly the weights the fixture returns (tolerance 0:
bit for bit), and the file holds exactly the raw blocks the fixture returns; paradecode-export exports
a file of each family.

transformers reads every family from GGUF, mistral as a llama model: llama.cpp writes Mistral checkpoints
with architecture "llama", and transformers' only route to MistralForCausalLM (a file named exactly
"mistral") fails because gguf-py has no "mistral" architecture (see
test_transformers_cannot_build_a_mistral_model_from_gguf).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from paradecode.export import cli
from paradecode.export.families import registered_families
from tests.tiny_gguf import (
    BLOCK_TYPES,
    K_QUANTS,
    LAYOUTS,
    VOCAB_SIZE,
    TinyShape,
    mixed_q4_k,
    pack_k_scales,
    permute_for_gguf,
    read_gguf_tensors,
    shape_for,
    unpermute_from_gguf,
    write_tiny_gguf,
)
from tests.tiny_gguf.blocks import random_tensor, weight_std

gguf = pytest.importorskip("gguf", reason="the gguf package is needed to write and read GGUF files (paradecode[gguf])")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file (paradecode[gguf])")

FAMILIES = sorted(LAYOUTS)
TYPES = [t.name for t in BLOCK_TYPES]
MIXED = "mixed-Q4_K"  # Q4_K with Q6_K where llama.cpp's Q4_K_M puts it
MATRIX = [pytest.param(f, t, id=f"{f}-{t}") for f in FAMILIES for t in TYPES]
# One block type per family for the (slow) export, spread over the kinds of block.
EXPORTED = {
    "llama": MIXED,
    "qwen2": "Q5_K",
    "qwen3": "Q6_K",
    "mistral": "Q4_0",
    "gpt2": "Q5_1",
    "gemma3": "Q5_0",
    "phi3": "Q4_K",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(family, block type or MIXED, tied) -> the TinyGGUF written for it: once per module, each in its folder."""
    files = {}

    def get(family: str, types: str, tied: bool = False):
        if (family, types, tied) not in files:
            path = tmp_path_factory.mktemp(f"gguf-{family}") / f"tiny-{family}.{types}.gguf"
            block_types = mixed_q4_k(shape_for(family, "Q4_K").layers, tied) if types == MIXED else types
            files[family, types, tied] = write_tiny_gguf(path, family=family, block_types=block_types, tied=tied)
        return files[family, types, tied]

    return get


def transformers_load(path: Path):
    """transformers' own loading of the file, and its loading report."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True
    )


def assert_reads_back_exactly(weights) -> None:
    """transformers loads the file completely, as the expected architecture and shape, to the very same floats."""
    model, info = transformers_load(weights.path)
    report = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not any(report.values()), report
    assert model.config.model_type == weights.model_type
    state = model.state_dict()
    extra = set(state) - set(weights)
    assert extra == ({"lm_head.weight"} if weights.tied else set()), sorted(extra)
    worst = max(float((state[k] - torch.from_numpy(v)).abs().max()) for k, v in weights.items())
    print(f"largest difference from the weights written (tolerance 0): {worst:.1e}")
    differ = sorted(k for k, v in weights.items() if not torch.equal(state[k], torch.from_numpy(v)))
    assert not differ, f"{len(differ)} of {len(weights)} weights differ, e.g. {differ[:4]}"
    embed = weights.tensors["token_embd.weight"].hf_name
    if weights.tied:
        assert torch.equal(state["lm_head.weight"], state[embed])
    config, shape = model.config, weights.shape
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (shape.layers, shape.hidden, VOCAB_SIZE)
    assert config.num_attention_heads == shape.heads
    assert getattr(config, "num_key_value_heads", shape.heads) == shape.kv_heads
    assert getattr(config, "head_dim", shape.head_dim) == shape.head_dim


# --- the registry ----------------------------------------------------------------------------------


def test_every_registered_family_has_a_gguf_layout():
    missing = sorted(set(registered_families()) - set(LAYOUTS))
    assert not missing, f"registered families without a GGUF layout in tests/tiny_gguf/layouts.py: {missing}"


# --- every family x block type: transformers reads back the weights written ---------------------------


@pytest.mark.parametrize(("family", "block_type"), MATRIX)
def test_transformers_reads_back_the_weights_written(written, family, block_type):
    weights = written(family, block_type)
    assert {t.tensor_type.name for t in weights.tensors.values() if t.spec.role == "matrix"} == {block_type}
    assert_reads_back_exactly(weights)


@pytest.mark.parametrize(("family", "block_type"), MATRIX)
def test_file_holds_the_blocks_returned(written, family, block_type):
    """The file's raw tensors are the returned ones; `dequantize()` is gguf's dequantization of them."""
    weights = written(family, block_type)
    in_file = read_gguf_tensors(weights.path)
    assert list(in_file) == list(weights.tensors)
    for name, tensor in weights.tensors.items():
        qtype, data = in_file[name]
        assert qtype == tensor.tensor_type, name
        assert data.dtype == tensor.data.dtype and np.array_equal(data, tensor.data), name
        values = gguf.quants.dequantize(data, qtype)
        assert np.array_equal(tensor.dequantize(), values), name
        assert np.array_equal(weights[tensor.hf_name], tensor.spec.to_hf(values)), name
    norms = [t for t in weights.tensors.values() if t.spec.role != "matrix"]
    assert norms and all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in norms)


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_embeddings_leave_out_the_output_matrix(written, family):
    weights = written(family, "Q8_0", tied=True)
    assert "output.weight" not in weights.tensors and "lm_head.weight" not in weights
    assert_reads_back_exactly(weights)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixed_q4_k_and_q6_k_as_llama_cpp_mixes_them(written, family, tied):
    weights = written(family, MIXED, tied)
    types = {name: t.tensor_type.name for name, t in weights.tensors.items() if t.spec.role == "matrix"}
    last = weights.shape.layers - 1
    assert types["token_embd.weight"] == ("Q6_K" if tied else "Q4_K")
    assert types.get("output.weight", "Q6_K") == "Q6_K"
    assert types[f"blk.{last}.ffn_down.weight"] == "Q6_K" and types["blk.0.ffn_up.weight"] == "Q4_K"
    assert_reads_back_exactly(weights)


def test_layout_changes_are_real(written):
    """The file's Q/K rows are permuted (llama, mistral) and GPT-2's matrices transposed, so the
    read-back test above checks that transformers' layout changes are undone correctly."""
    for family in ("llama", "mistral"):
        weights = written(family, "Q8_0")
        q = weights.tensors["blk.0.attn_q.weight"]
        assert q.spec.layout == "permuted" and q.spec.heads == weights.shape.heads
        assert not np.array_equal(q.hf_weight(), q.dequantize())
        assert np.array_equal(permute_for_gguf(q.hf_weight(), q.spec.heads), q.dequantize())
    for family in ("qwen2", "qwen3"):
        assert written(family, "Q8_0").tensors["blk.0.attn_q.weight"].spec.layout == "as-is"
    qkv = written("gpt2", "Q8_0").tensors["blk.0.attn_qkv.weight"]
    d = written("gpt2", "Q8_0").shape.hidden
    assert qkv.spec.shape == (3 * d, d) and qkv.hf_weight().shape == (d, 3 * d)


# --- blocks ----------------------------------------------------------------------------------------


def test_k_quant_scales_pack_as_gguf_unpacks_them():
    rng = np.random.default_rng(0)
    scales, mins = rng.integers(0, 64, (500, 8)), rng.integers(0, 64, (500, 8))
    unpacked = gguf.quants.Q4_K.get_scale_min(pack_k_scales(scales, mins))
    assert np.array_equal(unpacked[0], scales) and np.array_equal(unpacked[1], mins)
    with pytest.raises(ValueError, match="6-bit"):
        pack_k_scales(np.full((1, 8), 64), np.zeros((1, 8)))


@pytest.mark.parametrize("block_type", TYPES)
def test_blocks_decode_to_weights_of_a_sensible_size(block_type):
    """About weight_std(row length) (0.05 for these rows of 1024), centred, finite."""
    qtype = gguf.GGMLQuantizationType[block_type]
    data = random_tensor(qtype, (64, 1024), np.random.default_rng(1))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8 and data.shape == (64, 1024 // block * size)
    values = gguf.quants.dequantize(data, qtype)
    print(f"{block_type}: std {values.std():.3f}, mean {values.mean():+.4f}, largest {np.abs(values).max():.2f}")
    assert 0.85 < values.std() / weight_std(1024) < 1.15 and abs(values.mean()) < 0.005 and np.isfinite(values).all()
    if qtype in K_QUANTS:  # positive, normal fp16 super-block scales; sub-block scales over a wide range
        blocks = data.reshape(-1, size)
        d = blocks[:, -2:] if block_type == "Q6_K" else blocks[:, :2]
        assert (d.copy().view("<f2") >= 6.1e-5).all()
        if block_type == "Q6_K":  # signed, the range narrowed where a full one would need a subnormal d
            scales = set(blocks[:, 192:208].view(np.int8).ravel().tolist())
            assert scales == set(range(min(scales), -min(scales))) and min(scales) <= -32
        else:
            scales, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
            assert set(scales.ravel()) == set(mins.ravel()) == set(range(64))


def test_permutation_is_undone_by_its_inverse():
    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    assert np.array_equal(unpermute_from_gguf(permute_for_gguf(w, 3), 3), w)
    assert not np.array_equal(permute_for_gguf(w, 3), w)


# --- what the fixture refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(dict(block_types="Q4_K", shape=TinyShape()), "token_embd.weight .* rows of 64", id="k-rows"),
        pytest.param(dict(block_types="Q3_K"), "is not one the tiny GGUF files write", id="unknown-type"),
        pytest.param(dict(block_types={"ffn_gatee": "Q8_0"}), r"names \['ffn_gatee'\]", id="unknown-key"),
        pytest.param(dict(family="qwen3", shape=TinyShape(key_length=64)), "read with head size 128", id="qwen3-head"),
        pytest.param(dict(family="qwen2", shape=TinyShape(key_length=32)), "other than hidden //", id="qwen2-head"),
        pytest.param(dict(family="gpt2", with_tokenizer=False), "vocab_size from the token list", id="gpt2-vocab"),
        pytest.param(dict(family="gpt2", shape=TinyShape(kv_heads=4, context=1024)), r"4 \* n_embd", id="gpt2-ffn"),
        pytest.param(dict(family="bert"), "no tiny GGUF layout for family 'bert'", id="family"),
    ],
)
def test_shapes_transformers_would_misread_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_tiny_gguf(tmp_path / "x.gguf", **kwargs)
    assert not (tmp_path / "x.gguf").exists()


def test_transformers_cannot_build_a_mistral_model_from_gguf(tmp_path):
    """Why the mistral fixture is read as llama: transformers builds a MistralForCausalLM only from a llama
    file whose general.name is exactly "mistral", then looks up a "mistral" architecture in gguf-py's
    MODEL_ARCH_NAMES to map tensor names, and gguf-py has none."""
    named = gguf.GGUFWriter.add_name
    with mock.patch.object(gguf.GGUFWriter, "add_name", lambda writer, name: named(writer, "mistral")):
        write_tiny_gguf(tmp_path / "mistral.gguf", family="mistral")
    assert "mistral" not in gguf.MODEL_ARCH_NAMES.values()
    with pytest.raises(NotImplementedError, match="Unknown gguf model_type: mistral"):
        transformers_load(tmp_path / "mistral.gguf")


# --- paradecode-export of each family -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_each_family_passes_validation(written, family, tmp_path):
    weights = written(family, EXPORTED[family])
    out = tmp_path / "export"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = cli.main([str(weights.path), "-o", str(out), "--max-seq-len", "32", "--exit-layers", "1"])
    printed = printed.getvalue()
    assert code == 0, printed
    checks = [line.strip() for line in printed.splitlines() if line.strip().startswith("[")]
    assert checks and all(line.startswith("[  ok]") for line in checks), printed
    model = json.loads((out / "manifest.json").read_text())["model"]
    assert model["model_type"] == weights.model_type and model["gguf_file"] == str(weights.path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_a_gguf_of_the_newer_families_decodes_as_transformers_generate(written, family, tmp_path):
    """The file's blocks kept, float activations: plain decoding and ParaDecode (every token exiting at layer 1, so
    nearly every one rolling back) give transformers' greedy tokens on its own (dequantized) model of the file;
    gemma3's window of 5 is shorter than the prompt."""
    from paradecode.runtime import load
    from tests.parity import assert_same_tokens, hf_scorer

    weights = written(family, EXPORTED[family])
    out = tmp_path / "export"
    printed = io.StringIO()
    argv = [weights.path, "-o", out, "--max-seq-len", "64", "--exit-layers", "1", "--activations", "float"]
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        assert cli.main([str(a) for a in argv]) == 0, printed.getvalue()
    hf = transformers_load(weights.path)[0].eval()
    prompt = torch.randint(3, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    expected = generated[0, len(prompt) :].tolist()
    with load(out) as model:
        for mode in ("ar", "paradecode"):
            result = model.generate(prompt_ids=prompt, max_new_tokens=30, mode=mode, thresholds=0.0, ignore_eos=True)
            assert_same_tokens(result.token_ids, expected, f"{family} GGUF {mode}", prompt=prompt, score=hf_scorer(hf))
