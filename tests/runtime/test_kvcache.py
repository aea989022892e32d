"""The KV cache: per-layer lengths, rollback to any position, and decoding after a rollback."""

import itertools

import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import NEVER, Tracing, load
from paradecode.runtime.decoding import DecodeContext
from paradecode.runtime.kvcache import KVCache


def test_lengths_per_layer_and_rollback():
    cache = KVCache(3, (1, 2, 16, 4), torch.float32, "cpu")
    cache.written(1, 9)
    cache.written(2, 7)
    cache.written(3, 5)
    assert cache.lengths == [9, 7, 5]
    cache.rollback(6)
    assert cache.lengths == [6, 6, 5]
    cache.rollback(0)
    assert cache.lengths == [0, 0, 0]
    with pytest.raises(UserInputError, match="16 slots"):
        cache.written(1, 17)
    with pytest.raises(ValueError):
        cache.rollback(-1)


def test_buffers_are_allocated_once(exports):
    folder, _ = exports["qwen3"]
    with load(folder) as model:
        model.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, thresholds=0.0, ignore_eos=True)
        (engine,) = model._idle  # the call's engine, kept for the next call
        pointers = [t.data_ptr() for t in engine.cache.keys + engine.cache.values]
        model.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, thresholds=0.0, ignore_eos=True)
        assert model._idle == [engine]
        assert [t.data_ptr() for t in engine.cache.keys + engine.cache.values] == pointers
        assert engine.cache.shape == (1, 1, 64, 16)


def test_shallow_layers_hold_more_positions_while_tokens_are_pending(exports, monkeypatch):
    folder, _ = exports["llama"]
    with load(folder) as model:
        snapshots = []
        timed = DecodeContext._timed

        def recording(ctx, *args):  # the lengths as the scheduler leaves them before each call
            snapshots.append(list(ctx.cache.lengths))
            return timed(ctx, *args)

        monkeypatch.setattr(DecodeContext, "_timed", recording)
        model.generate(
            prompt_ids=[5, 6, 7],
            max_new_tokens=30,
            thresholds=0.0,
            overlap="batched",
            max_unverified=6,
            ignore_eos=True,
        )
    assert all(a >= b for s in snapshots for a, b in itertools.pairwise(s)), "deeper layers never hold more positions"
    assert any(s[0] > s[-1] for s in snapshots), f"no pending positions seen: {snapshots}"


def test_stale_slots_after_a_rollback_do_not_matter(exports):
    """Decode one continuation, roll back, decode another: equal to decoding the second from scratch."""
    folder, _ = exports["mistral"]
    with load(folder, backend="torch") as model:
        backend = model.backend
        cache = backend.allocate_cache()

        def run(tokens, start):
            positions = torch.arange(start, start + len(tokens))[None]
            hidden = backend.run("embed", {"input_ids": torch.tensor([tokens])})["hidden"]
            for layer in range(1, model.manifest.spec.num_layers + 1):
                key, value = cache.layer(layer)
                feeds = {"hidden": hidden, "positions": positions, "past_key": key, "past_value": value}
                hidden = backend.run(f"layer_{layer}", feeds)["hidden_out"]
            return backend.run("final", {"hidden": hidden})["token"].tolist()

        cache.reset()
        run([1, 2, 3, 4], 0)
        run([9, 9, 9, 9, 9, 9], 4)  # fills slots 4..9 with values that must become irrelevant
        cache.rollback(4)
        after_rollback = run([7, 8], 4)
        cache.reset()
        torch.manual_seed(0)
        for k, v in zip(cache.keys, cache.values):
            k.normal_(), v.normal_()  # garbage everywhere: only positions <= p may matter
        run([1, 2, 3, 4], 0)
        fresh = run([7, 8], 4)
    assert after_rollback == fresh


def test_never_exit_runs_no_exit_head(exports):
    """Neither a separate exit head (exit_e) nor a fused layer+exit graph (layer_exit_e): the export has both."""
    folder, _ = exports["gpt2"]
    with load(folder) as model:
        available = model.backend.subgraph_names
        result = model.generate(
            prompt_ids=[1, 2], max_new_tokens=12, thresholds=NEVER, tracing=Tracing(spans=True), ignore_eos=True
        )
    assert any(n.startswith("exit_") for n in available) and any(n.startswith("layer_exit_") for n in available)
    names = {span.name for span in result.timeline.spans}
    layers = {f"layer_{i}" for i in range(1, model.manifest.spec.num_layers + 1)}
    assert layers <= names, f"the trace does not show every layer running: {sorted(names)}"
    assert not any(name.startswith(("exit_", "layer_exit_")) for name in names), sorted(names)
