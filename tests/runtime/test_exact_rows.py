"""Exact rows (export/exact_rows.py): with int8 activations, a position's layer results are the same bit for bit
whatever its call's token count, so ParaDecode's tokens are plain decoding's exactly, near ties included.

On the bare attention kernel first: onnxruntime's GroupQueryAttention computes a one-token call otherwise than the
same query among others (the negative control: without the rewrite the rows differ), and the rewritten graph
gives every row alike. Then on the tiny GGUF exports with int8 activations everywhere (`gguf-int8`) of the
families whose heads the fused kernel runs: layer graphs at 1 and 4 tokens, ParaDecode against ar with no near-tie
allowance (every token exits and most roll back), and a batch of requests against each request alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from paradecode.export.exact_rows import pad_attention_rows
from paradecode.runtime import load
from paradecode.runtime.batching import generate_batched
from paradecode.runtime.decoding import MAIN, DecodeContext
from paradecode.runtime.lanes import Timeline
from paradecode.runtime.stats import GenerationStats
from tests.tiny_models import TINY_CONFIGS

ort = pytest.importorskip("onnxruntime")

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 4, 2, 64, 96


def attention_graph(padded: bool) -> bytes:
    """One GroupQueryAttention over a [1, KV_HEADS, SLOTS, HEAD_DIM] cache, as a layer graph calls it."""
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, "T", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [1, KV_HEADS, SLOTS, HEAD_DIM]),
        helper.make_tensor_value_info("past_value", TensorProto.FLOAT, [1, KV_HEADS, SLOTS, HEAD_DIM]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [1, "T"]),  # what the padding reads
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_key", "past_value", "seqlens", "total"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
    )
    cache = [1, KV_HEADS, SLOTS, HEAD_DIM]
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "T", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    if padded:
        assert pad_attention_rows(graph) == 1
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def rows_alone_and_together(padded: bool, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The outputs of `tokens` queries from slot `start` in one call, and each in a call of its own."""
    session = ort.InferenceSession(attention_graph(padded), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, tokens, n * HEAD_DIM), dtype=np.float32) for n in (HEADS, KV_HEADS, KV_HEADS))
    cache = [rng.standard_normal((1, KV_HEADS, SLOTS, HEAD_DIM), dtype=np.float32) for _ in range(2)]

    def run(first: int, last: int, key: np.ndarray, value: np.ndarray) -> list[np.ndarray]:
        feeds = {"q": q[:, first:last], "k": k[:, first:last], "v": v[:, first:last]}
        feeds |= {"past_key": key.copy(), "past_value": value.copy()}
        feeds |= {"seqlens": np.array([start + last - 1], np.int32), "total": np.array(start + last, np.int32)}
        feeds |= {"positions": np.arange(start + first, start + last, dtype=np.int64)[None]}
        return session.run(["out", "present_key", "present_value"], feeds)

    together, key, value = run(0, tokens, *cache)
    # each row alone over the caches the call of all of them wrote: the earlier rows' keys and values in place
    return together, np.concatenate([run(i, i + 1, key, value)[0] for i in range(tokens)], axis=1)


def test_the_attention_kernel_computes_a_lone_row_otherwise():
    """The negative control: what the rewrite is for. If onnxruntime ever computes one row as it does several,
    this fails and the rewrite can go."""
    together, alone = rows_alone_and_together(False, start=40, tokens=4)
    assert not np.array_equal(together, alone)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)  # the same attention, rounded otherwise


@pytest.mark.parametrize("start", [0, 7, 40, SLOTS - 5])
def test_padded_attention_computes_every_row_alike(start):
    together, alone = rows_alone_and_together(True, start=start, tokens=4)
    assert np.array_equal(together, alone)
    reference, _ = rows_alone_and_together(False, start=start, tokens=4)
    assert np.array_equal(together, reference)  # several rows: the kernel's own results, the copy dropped


def test_a_call_ending_at_the_last_slot_is_left_as_it_is():
    """No slot after it for the copy: the one-row call keeps the kernel's one-token path (documented)."""
    padded, _ = rows_alone_and_together(True, start=SLOTS - 1, tokens=1)
    plain, _ = rows_alone_and_together(False, start=SLOTS - 1, tokens=1)
    assert np.array_equal(padded, plain)


@pytest.fixture(scope="module")
def int8_models(quantized_exports):
    loaded = {}
    for family in sorted(TINY_CONFIGS):
        model = load(quantized_exports[family, "gguf-int8"][0])
        if model.manifest.padded_attention:
            loaded[family] = model
        else:
            model.close()
    assert loaded, "no tiny family exports the fused attention with int8 activations: nothing would be tested"
    yield loaded
    for model in loaded.values():
        model.close()


PROMPT = [5, 17, 42, 9, 3, 61, 8]


@pytest.mark.slow
def test_int8_layers_give_a_position_the_same_bits_at_any_token_count(int8_models):
    for family, model in int8_models.items():
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(1), Timeline(), GenerationStats("ar"))
        layers = ctx.num_layers
        hidden = ctx.embed(MAIN, PROMPT, 0)
        together = ctx.layers(MAIN, 1, layers, hidden, 0).clone()
        alone = torch.cat([ctx.layers(MAIN, 1, layers, hidden[:, i : i + 1], i).clone() for i in range(len(PROMPT))], 1)
        assert torch.equal(together, alone), f"{family}: max |diff| {(together - alone).abs().max():.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["batched", "streams"])
def test_paradecode_equals_ar_exactly_with_int8_activations(int8_models, overlap):
    for family, model in int8_models.items():
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=40, mode="ar", ignore_eos=True)
        ours = model.generate(
            prompt_ids=PROMPT, max_new_tokens=40, thresholds=0.0, overlap=overlap, max_unverified=5, ignore_eos=True
        )
        assert sum(ours.stats.exits_per_layer.values()) > 0, family
        assert ours.token_ids == ar.token_ids, f"{family} {overlap}: no near-tie allowance here"


@pytest.mark.slow
def test_a_batch_on_an_int8_export_equals_each_request_alone_exactly(int8_models):
    for family, model in int8_models.items():
        generator = torch.Generator().manual_seed(11)
        vocab = model.manifest.spec.vocab_size
        requests = [
            model.request(
                prompt_ids=torch.randint(0, vocab, (n,), generator=generator).tolist(),
                max_new_tokens=m,
                mode="ar",
                ignore_eos=True,
            )
            for n, m in ((5, 20), (11, 9), (3, 25))
        ]
        expected = [model.generate(prompt_ids=r.ids, config=r.config).token_ids for r in requests]
        assert [r.token_ids for r in generate_batched(model, requests, rows=2)] == expected, family
