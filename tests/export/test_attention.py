"""The exported attention (export/attention.py): a CacheAttention placeholder expanded into standard operators
computes what the PyTorch reference computes (rotary embeddings, the in-place cache write, grouped heads, the causal
mask and sliding windows, several rows at positions of their own), and a position's result does not depend on what
else its call holds: other positions, other rows, or how many slots its cache has past the ones it sees."""

from __future__ import annotations

import itertools

import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from paradecode.export.attention import expand_attention
from paradecode.graphs import ops
from paradecode.graphs.ortvalues import ort_value

ort = pytest.importorskip("onnxruntime")

KV_HEADS, HEAD_DIM, MAX_POSITIONS = 2, 16, 64
F = TensorProto.FLOAT


def graph(heads: int, window: int, rotary: str) -> onnx.ModelProto:
    """One placeholder over caches [B, KV_HEADS, S, HEAD_DIM], expanded; `rotary`: "op", "elementwise" or "none"."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    cos, sin = ops.rope_caches(inv_freq, 1.0, MAX_POSITIONS, torch.float32)
    cache = ["B", KV_HEADS, "S", HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("q", F, ["B", "T", heads * HEAD_DIM]),
        helper.make_tensor_value_info("k", F, ["B", "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("v", F, ["B", "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("past_key", F, cache),
        helper.make_tensor_value_info("past_value", F, cache),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["B", "T"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", F, ["B", "T", heads * HEAD_DIM]),
        helper.make_tensor_value_info("present_key", F, cache),
        helper.make_tensor_value_info("present_value", F, cache),
    ]
    tables = [] if rotary == "none" else ["cos", "sin"]
    node = helper.make_node(
        ops.ATTENTION_OP,
        ["q", "k", "v", "past_key", "past_value", "positions", *tables],
        ["out", "present_key", "present_value"],
        domain=ops.ATTENTION_DOMAIN,
        num_heads=heads,
        kv_num_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        scale=HEAD_DIM**-0.5,
        window=window,
        rotary_dim=0 if rotary == "none" else HEAD_DIM,
        rotary_op=int(rotary == "op"),
        dtype=F,
    )
    initializers = [numpy_helper.from_array(t.numpy(), n) for n, t in (("cos", cos), ("sin", sin))] if tables else []
    model = helper.make_model(
        helper.make_graph([node], "attention", inputs, outputs, initializers),
        opset_imports=[helper.make_opsetid("", 24)],
    )
    model.ir_version = 10
    assert expand_attention(model.graph) == 1
    onnx.checker.check_model(model)
    return model


def reference(heads, window, rotary, q, k, v, key, value, positions):
    """The PyTorch modules' attention (graphs/ops.py), the caches written in place."""
    batch, tokens, _ = q.shape
    q = q.view(batch, tokens, heads, HEAD_DIM).transpose(1, 2)
    k = k.view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = v.view(batch, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
    if rotary != "none":
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        cos, sin = ops.rope_cos_sin(positions, inv_freq, 1.0, torch.float32)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    ops.write_cache(key, k, positions[:, 0])
    ops.write_cache(value, v, positions[:, 0])
    out = ops.attention(q, key, value, positions, scale=HEAD_DIM**-0.5, window=window or None)
    return out.transpose(1, 2).reshape(batch, tokens, heads * HEAD_DIM)


def run(session, q, k, v, key, value, positions) -> torch.Tensor:
    """The graph over `key` and `value`, written in place as the runtime binds them."""
    binding = session.io_binding()
    for name, tensor in (("q", q), ("k", k), ("v", v), ("positions", positions)):
        binding.bind_ortvalue_input(name, ort_value(tensor.contiguous()))
    for name, tensor in (("past_key", key), ("past_value", value)):
        binding.bind_ortvalue_input(name, ort_value(tensor))
    binding.bind_output("out")
    binding.bind_ortvalue_output("present_key", ort_value(key))
    binding.bind_ortvalue_output("present_value", ort_value(value))
    session.run_with_iobinding(binding)
    return torch.from_numpy(binding.get_outputs()[0].numpy().copy())


def session_of(model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def inputs(heads: int, starts: list[int], tokens: int, slots: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch = len(starts)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = (
        rand(batch, tokens, heads * HEAD_DIM),
        rand(batch, tokens, KV_HEADS * HEAD_DIM),
        rand(batch, tokens, KV_HEADS * HEAD_DIM),
    )
    caches = rand(batch, KV_HEADS, slots, HEAD_DIM), rand(batch, KV_HEADS, slots, HEAD_DIM)  # stale slots: masked
    positions = torch.tensor(starts)[:, None] + torch.arange(tokens)
    return q, k, v, caches, positions


CASES = list(itertools.product((2, 6), (0, 5), ("op", "elementwise", "none")))  # query heads, window, rotary


@pytest.mark.parametrize(("heads", "window", "rotary"), CASES)
def test_the_expanded_attention_computes_what_the_modules_do(heads, window, rotary):
    session = session_of(graph(heads, window, rotary))
    worst = 0.0
    for starts, tokens, slots in (([9], 1, 16), ([0, 7], 4, 16), ([3, 20], 3, 32), ([30, 2], 1, 64)):
        q, k, v, (key, value), positions = inputs(heads, starts, tokens, slots)
        ours_key, ours_value = key.clone(), value.clone()
        got = run(session, q, k, v, ours_key, ours_value, positions)
        want = reference(heads, window, rotary, q, k, v, key, value, positions)
        worst = max(worst, float((got - want).abs().max()))
        for row, start in enumerate(starts):  # the new keys and values written at their slots, the rest untouched
            written = slice(start, start + tokens)
            assert torch.allclose(ours_key[row, :, written], key[row, :, written], atol=1e-5)
            assert torch.equal(ours_value[row, :, written], value[row, :, written])
            assert torch.equal(ours_key[row, :, :start], key[row, :, :start])
    print(f"heads {heads} window {window} rotary {rotary}: max |Δ| against the modules {worst:.1e} (tolerance 1e-5)")
    assert worst < 1e-5


@pytest.mark.parametrize(("heads", "window"), [(2, 0), (6, 5)])
def test_a_position_gets_the_same_bits_whatever_its_call_holds(heads, window):
    """Row 0's four positions in one call of two rows over a 64-slot cache, against each of them alone (one row,
    one position) over a 16-slot cache holding the same earlier keys and values: the same bits, on this CPU."""
    session = session_of(graph(heads, window, "op"))
    q, k, v, (key, value), positions = inputs(heads, [8, 30], 4, 64, seed=1)
    together = run(session, q, k, v, key.clone(), value.clone(), positions)
    small_key, small_value = key[:1, :, :16].clone(), value[:1, :, :16].clone()
    alone = [
        run(
            session,
            q[:1, i : i + 1],
            k[:1, i : i + 1],
            v[:1, i : i + 1],
            small_key,
            small_value,
            positions[:1, i : i + 1],
        )
        for i in range(4)
    ]
    assert torch.equal(together[:1], torch.cat(alone, 1)), f"max |Δ| {(together[:1] - torch.cat(alone, 1)).abs().max()}"


def test_a_graph_without_placeholders_is_left_alone():
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "plain",
            [helper.make_tensor_value_info("x", F, [1])],
            [helper.make_tensor_value_info("y", F, [1])],
        )
    )
    assert expand_attention(model.graph) == 0 and [n.op_type for n in model.graph.node] == ["Relu"]


def test_a_window_shorter_than_the_cache_exports_with_the_defaults_and_decodes_as_transformers(tmp_path):
    """A Mistral model whose window (12) is shorter than its cache, head_dim 16, 4 layers: the default export (fused
    operators) validates, and plain decoding and ParaDecode past the window give transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.runtime import load
    from tests.tiny_models import hf_greedy

    config = MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=12,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3 if "emb" in name else 0.15)
    model.save_pretrained(tmp_path / "mistral")
    export_model(ExportConfig(model=str(tmp_path / "mistral"), output=tmp_path / "export", max_seq_len=64))
    prompt = [(7 * i + 3) % 97 for i in range(20)]  # longer than the window
    want = hf_greedy(model, prompt, 24)
    loaded = load(tmp_path / "export")
    try:
        assert loaded.generate(prompt_ids=prompt, max_new_tokens=24, mode="ar", ignore_eos=True).token_ids == want
        got = loaded.generate(prompt_ids=prompt, max_new_tokens=24, mode="paradecode", thresholds=0.0, ignore_eos=True)
        assert got.token_ids == want
    finally:
        loaded.close()
