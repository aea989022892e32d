"""Exact rows (export/exact_rows.py): with int8 activations, a position's layer results are the same bit for bit
whatever its call's token count (in the form the runtime picks for the machine: runtime/row_exactness.py), so
ParaDecode's tokens are plain decoding's exactly, near ties included.

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
from paradecode.graphs.tensors import HIDDEN_OUT
from paradecode.runtime import load, row_exactness
from paradecode.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
from paradecode.runtime.decoding import MAIN, DecodeContext
from paradecode.runtime.engine import generate_batched
from paradecode.runtime.lanes import Timeline
from tests.tiny_models import TINY_CONFIGS

ort = pytest.importorskip("onnxruntime")

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 4, 2, 64, 96
WIDTHS = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)  # queries, keys, values


def attention_graph(padded: bool, split: bool) -> bytes:
    """One GroupQueryAttention over a [B, KV_HEADS, SLOTS, HEAD_DIM] cache, as a layer graph calls it: its queries,
    keys and values split from one tensor (`split`, as a quantized layer's one product gives them) or given apart."""
    cache = ["B", KV_HEADS, SLOTS, HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["B", "T"]),  # what the padding reads
    ]
    nodes = []
    if split:
        inputs.append(helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "T", sum(WIDTHS)]))
        sizes = helper.make_tensor("sizes", TensorProto.INT64, [3], list(WIDTHS))
        nodes.append(helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1))
        initializers = [sizes]
    else:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", w]) for n, w in zip("qkv", WIDTHS)]
        initializers = []
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key", "past_value", "seqlens", "total"],
            ["out", "present_key", "present_value"],
            domain="com.microsoft",
            num_heads=HEADS,
            kv_num_heads=KV_HEADS,
        )
    )
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "T", WIDTHS[0]]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializers)
    if padded:
        assert pad_attention_rows(graph) == 1
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


class Attention:
    """The graph on random queries, keys, values and caches: `run(first, last, start)` computes rows first..last-1
    (each row of the batch at positions start..) over copies of the caches given, returning (out, key, value)."""

    def __init__(self, padded: bool, split: bool, tokens: int, rows: int = 1):
        self.session = ort.InferenceSession(attention_graph(padded, split), providers=["CPUExecutionProvider"])
        self.split = split
        rng = np.random.default_rng(3)
        self.q, self.k, self.v = (rng.standard_normal((rows, tokens, w), dtype=np.float32) for w in WIDTHS)
        self.cache = [rng.standard_normal((rows, KV_HEADS, SLOTS, HEAD_DIM), dtype=np.float32) for _ in range(2)]

    def run(self, first: int, last: int, start: int, key=None, value=None) -> list[np.ndarray]:
        key = self.cache[0] if key is None else key
        value = self.cache[1] if value is None else value
        rows = self.q.shape[0]
        q, k, v = self.q[:, first:last], self.k[:, first:last], self.v[:, first:last]
        feeds = {"qkv": np.concatenate([q, k, v], axis=-1)} if self.split else {"q": q, "k": k, "v": v}
        feeds |= {"past_key": key.copy(), "past_value": value.copy(), "total": np.array(start + last, np.int32)}
        feeds |= {"seqlens": np.full(rows, start + last - 1, np.int32)}
        feeds |= {"positions": np.tile(np.arange(start + first, start + last, dtype=np.int64), (rows, 1))}
        return self.session.run(["out", "present_key", "present_value"], feeds)


def rows_alone_and_together(padded: bool, split: bool, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The outputs of `tokens` queries from slot `start` in one call, and each in a call of its own (over the caches
    the call of all of them wrote: the earlier rows' keys and values in place)."""
    attention = Attention(padded, split, tokens)
    together, key, value = attention.run(0, tokens, start)
    alone = [attention.run(i, i + 1, start, key, value)[0] for i in range(tokens)]
    return together, np.concatenate(alone, axis=1)


@pytest.mark.parametrize("split", [False, True], ids=["apart", "split"])
def test_the_attention_kernel_computes_a_lone_row_otherwise(split):
    """The negative control: what the rewrite is for. If onnxruntime ever computes one row as it does several,
    this fails and the rewrite can go."""
    together, alone = rows_alone_and_together(False, split, start=40, tokens=4)
    assert not np.array_equal(together, alone)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)  # the same attention, rounded otherwise


@pytest.mark.parametrize("split", [False, True], ids=["apart", "split"])
@pytest.mark.parametrize("start", [0, 7, 40, SLOTS - 5])
def test_padded_attention_computes_every_row_alike(start, split):
    together, alone = rows_alone_and_together(True, split, start=start, tokens=4)
    assert np.array_equal(together, alone)
    reference, _ = rows_alone_and_together(False, split, start=start, tokens=4)
    assert np.array_equal(together, reference)  # several rows: the kernel's own results, the copy dropped


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_copy_writes_the_slot_after_the_call_and_no_other(tokens):
    start = 20
    _, key, value = Attention(True, True, tokens).run(0, tokens, start)
    _, plain_key, plain_value = Attention(False, True, tokens).run(0, tokens, start)
    for padded, plain in ((key, plain_key), (value, plain_value)):
        after = start + tokens
        assert np.array_equal(padded[:, :, :after], plain[:, :, :after])  # the call's own slots: the kernel's
        assert np.array_equal(padded[:, :, after + 1 :], plain[:, :, after + 1 :])  # nothing later touched
        assert not np.array_equal(padded[:, :, after], plain[:, :, after])  # the copy's slot
        assert np.array_equal(padded[:, :, after], padded[:, :, after - 1])  # without rotary: the last row's again


def test_a_call_of_several_rows_gets_no_copy():
    """Batched requests (one token per row): the kernel refuses several rows of several tokens, so no copy."""
    padded = Attention(True, True, tokens=1, rows=3).run(0, 1, 30)
    plain = Attention(False, True, tokens=1, rows=3).run(0, 1, 30)
    for a, b in zip(padded, plain):
        assert np.array_equal(a, b)


def test_a_call_ending_at_the_last_slot_gets_no_copy():
    """No slot after it for the copy: the one-row call keeps the kernel's one-token path. The runtime never makes
    such a call on a padded export (its cache keeps that slot spare: test below); the graph stays safe anyway."""
    padded, _ = rows_alone_and_together(True, True, start=SLOTS - 1, tokens=1)
    plain, _ = rows_alone_and_together(False, True, start=SLOTS - 1, tokens=1)
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
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(1), Timeline())
        layers = ctx.num_layers
        hidden = ctx.embed(MAIN, PROMPT, 0)
        together = ctx.layers(MAIN, 1, layers, hidden, 0).clone()
        alone = torch.cat([ctx.layers(MAIN, 1, layers, hidden[:, i : i + 1], i).clone() for i in range(len(PROMPT))], 1)
        assert torch.equal(together, alone), f"{family}: max |diff| {(together - alone).abs().max():.3e}"


def test_a_prefill_gives_a_position_its_own_bits_on_every_core(quantized_exports, monkeypatch):
    """By default every session has a pool of every core that spins while its call runs and stops when it ends
    (runtime/backends/onnxruntime_backend.py, THREADS), and a prefill (a call of more than BOUND_TOKENS positions,
    bound afresh) gives each position the bits it gets alone. Two cores are pretended, so a one-core machine tests it
    too."""
    from paradecode.runtime.backends.onnxruntime_backend import BOUND_TOKENS

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    prompt = (PROMPT * 3)[: BOUND_TOKENS + 2]
    for threads, expected in ((None, 2), (3, 3)):
        with load(quantized_exports["llama", "gguf-int8"][0], threads=threads) as model:
            backend = model.backend
            assert backend.threads == expected
            ctx = DecodeContext(backend, backend.allocate_cache(1), Timeline())
            hidden = ctx.embed(MAIN, prompt, 0)
            together = ctx.layers(MAIN, 1, ctx.num_layers, hidden, 0).clone()
            alone = [ctx.layers(MAIN, 1, ctx.num_layers, hidden[:, i : i + 1], i) for i in range(len(prompt))]
            alone = torch.cat(alone, 1)
            assert torch.equal(together, alone), f"max |diff| {(together - alone).abs().max():.3e}"
            options = [s.get_session_options() for s in backend.sessions.values()]
            assert options and all(o.intra_op_num_threads == expected for o in options)
            assert all(o.get_session_config_entry("session.intra_op.allow_spinning") == "1" for o in options)
            assert all(o.get_session_config_entry("session.force_spinning_stop") == "1" for o in options)


def test_lanes_computing_at_once_share_the_cores(quantized_exports, monkeypatch):
    """In the `streams` overlap lane 0 and the side lane compute at once, so their calls run through sessions of
    their share of the threads (onnxruntime_backend's THREADS): 4 cores pretended, 2 lanes, 2 threads a call. A
    `batched` request makes no such session. Both keep plain decoding's output, to the bits of its margins."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    with load(quantized_exports["llama", "gguf-int8"][0]) as model:
        backend = model.backend
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=12, mode="ar", ignore_eos=True)
        batched = model.generate(prompt_ids=PROMPT, max_new_tokens=12, thresholds=0.0, ignore_eos=True)
        assert batched.token_ids == ar.token_ids and not backend._sharing_sessions
        streams = model.generate(
            prompt_ids=PROMPT, max_new_tokens=12, thresholds=0.0, overlap="streams", ignore_eos=True
        )
        assert streams.token_ids == ar.token_ids and sum(streams.stats.exits_per_layer.values()) > 0
        assert streams.margins == ar.margins  # plain decoding's bits, whichever threads the lanes took
        # calls on 2 threads where this machine gives a position the same bits on 2 as on 4 (checked at the first
        # such call), else on 4
        shared = {threads for _, threads in backend._sharing_sessions}
        assert shared == ({2} if backend._exact_shares == {2: True} else set()) and backend._exact_shares
        options = [s.get_session_options() for s in backend._sharing_sessions.values()]
        assert all(o.intra_op_num_threads == 2 for o in options)


def test_a_share_that_gives_every_threads_bits_is_used(quantized_exports, monkeypatch, tmp_path):
    """The check passes a share whose calls compute as calls on every thread (here made so: its sessions take every
    thread whatever they are asked), and the lanes then call on it."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    options = OnnxRuntimeBackend._options
    monkeypatch.setattr(OnnxRuntimeBackend, "_options", lambda self, threads=None: options(self))
    with load(quantized_exports["llama", "gguf-int8"][0]) as model:
        backend = model.backend
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=12, mode="ar", ignore_eos=True)
        streams = model.generate(
            prompt_ids=PROMPT, max_new_tokens=12, thresholds=0.0, overlap="streams", ignore_eos=True
        )
        assert backend._exact_shares == {2: True} and {t for _, t in backend._sharing_sessions} == {2}
        assert streams.token_ids == ar.token_ids and streams.margins == ar.margins


def test_a_share_whose_check_fails_is_not_used(quantized_exports, monkeypatch, caplog, tmp_path):
    """A check that raises (out of memory, say) fails no request: the share counts as inexact, said once."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def failing(backend, threads):
        raise MemoryError("no room for the check's cache")

    monkeypatch.setattr(row_exactness, "shares_exactly", failing)
    with load(quantized_exports["llama", "gguf-int8"][0]) as model:
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=12, mode="ar", ignore_eos=True)
        settings = dict(max_new_tokens=12, thresholds=0.0, overlap="streams", ignore_eos=True)
        with caplog.at_level("WARNING"):
            runs = [model.generate(prompt_ids=PROMPT, **settings) for _ in range(2)]
        assert model.backend._exact_shares == {2: False} and not model.backend._sharing_sessions
        said = [r.getMessage() for r in caplog.records if "checking calls on 2 of 4 threads failed" in r.getMessage()]
        assert len(said) == 1 and "no room for the check's cache" in said[0], said
        assert all(run.token_ids == ar.token_ids and run.margins == ar.margins for run in runs)


def test_lanes_keep_every_thread_where_a_share_would_change_the_bits(quantized_exports, monkeypatch, caplog, tmp_path):
    """Where calls on a share of the threads would give a position other bits (here made so: their hidden states one
    ulp off), the check at the first shared call finds it, says so, frees the sessions it made, and the lanes call on
    every thread: the `streams` overlap keeps plain decoding's output to the bits."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # checked here, not read from an earlier test's verdict
    with load(quantized_exports["llama", "gguf-int8"][0]) as model:
        backend = model.backend
        launch = type(backend)._launch

        def off_by_an_ulp_on_a_share(self, name, feeds, lane):
            outputs, reused = launch(self, name, feeds, lane)
            if self._call_threads() != self.threads and HIDDEN_OUT in outputs:
                hidden = outputs[HIDDEN_OUT]
                outputs = {**outputs, HIDDEN_OUT: torch.nextafter(hidden, torch.full_like(hidden, float("inf")))}
            return outputs, reused

        monkeypatch.setattr(type(backend), "_launch", off_by_an_ulp_on_a_share)
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=12, mode="ar", ignore_eos=True)
        settings = dict(max_new_tokens=12, thresholds=0.0, overlap="streams", ignore_eos=True)
        with caplog.at_level("INFO", logger="paradecode.runtime.row_exactness"):
            streams = model.generate(prompt_ids=PROMPT, **settings)
        assert backend._exact_shares == {2: False} and not backend._sharing_sessions
        assert "calls on 2 of 4 threads give positions other bits" in caplog.text
        assert streams.token_ids == ar.token_ids and streams.margins == ar.margins
        assert sum(streams.stats.exits_per_layer.values()) > 0


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
        assert ours.margins == ar.margins, f"{family} {overlap}: the final head's margins, bit for bit"


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


@pytest.mark.slow
def test_a_padded_export_keeps_its_last_slot_for_the_copy(int8_models):
    for family, model in int8_models.items():
        assert model.manifest.padded_attention
        assert model.capacity == model.manifest.max_seq_len - 1, family
        assert model.backend.allocate_cache(2).rows(1, 2).capacity == model.manifest.max_seq_len - 1, family
