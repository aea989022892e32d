"""Exact calls: with int8 activations, a position's results are the same bit for bit whatever its call holds (its
token count, the other rows of a batch, how many slots its cache has), in the form the runtime picks for the
machine (runtime/row_exactness.py), so ParaDecode's tokens are plain decoding's exactly, near ties included, and a
request decoded in a batch gets the tokens it gets alone.

On the tiny GGUF exports with int8 activations everywhere (`gguf-int8`) of every family: layer graphs at 1 and
several tokens, ParaDecode against ar with no near-tie allowance (every token exits and most roll back), a batch of
requests against each request alone, and the overlaps' shares of the threads.
"""

from __future__ import annotations

import pytest
import torch

from paradecode.graphs.tensors import HIDDEN_OUT
from paradecode.runtime import load, row_exactness
from paradecode.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
from paradecode.runtime.decoding import MAIN, DecodeContext
from paradecode.runtime.engine import generate_batched
from paradecode.runtime.tracing import Timeline
from tests.tiny_models import TINY_CONFIGS

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def int8_models(quantized_exports):
    loaded = {family: load(quantized_exports[family, "gguf-int8"][0]) for family in sorted(TINY_CONFIGS)}
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
    """The rows of a batch share every call (this machine's form permitting: `rows_alone` otherwise) and each row's
    tokens and margins are the request's alone, to the bits."""
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
        alone = [generate_batched(model.runtime, [r])[0] for r in requests]  # each in an engine of one row
        batched = generate_batched(model.runtime, requests, rows=2)
        assert [r.token_ids for r in batched] == [r.token_ids for r in alone], family
        assert [r.margins for r in batched] == [r.margins for r in alone], family
