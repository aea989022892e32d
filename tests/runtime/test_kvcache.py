"""The KV cache: per-layer lengths, rollback to any position, and decoding after a rollback."""

import gc
import itertools
import weakref

import numpy as np
import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import NEVER, Tracing, load
from paradecode.runtime.decoding import DecodeContext
from paradecode.runtime.kvcache import GRANULE, KVCache


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


def test_a_growing_cache_keeps_what_it_holds_and_its_views_follow():
    """A cache of 200 slots at most starts at GRANULE (64) and grows in steps of it to what a call needs: every
    row's slots are copied, the new ones are zeros, a view of some rows sees the new buffers, and a cache that does
    not grow holds every slot from the start."""
    cache = KVCache(2, (3, 1, 200, 2), torch.float32, "cpu", grows=True)
    assert cache.slots == GRANULE
    view = cache.rows(1, 3)
    for layer in (1, 2):
        for buffer in cache.layer(layer):
            buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32).view(buffer.shape) + 1)
    before = [t.clone() for layer in (1, 2) for t in cache.layer(layer)]
    cache.reserve(GRANULE)  # fits: nothing moves
    assert cache.slots == GRANULE and cache.generation == 0
    view.reserve(GRANULE + 1)
    assert cache.slots == 2 * GRANULE and cache.generation == 1
    after = [t for layer in (1, 2) for t in cache.layer(layer)]
    for old, new in zip(before, after):
        assert torch.equal(new[:, :, :GRANULE], old) and not new[:, :, GRANULE:].any()
    assert view.layer(1)[0].data_ptr() == cache.layer(1)[0][1].data_ptr() and view.layer(1)[0].shape[2] == 2 * GRANULE
    cache.reserve(10_000)  # past the most slots: the graphs refuse a call there; the cache stops at its most
    assert cache.slots == 200
    assert KVCache(1, (1, 1, 200, 2), torch.float32, "cpu").slots == 200


def held_slots(monkeypatch) -> list[int]:
    """The slots every cache holds after each `reserve`, from now on."""
    slots, reserve = [], KVCache.reserve

    def recording(cache, end):
        reserve(cache, end)
        slots.append(cache.slots)

    monkeypatch.setattr(KVCache, "reserve", recording)
    return slots


def test_a_caches_old_buffers_are_freed_when_it_grows_or_shrinks_though_its_views_are_kept():
    """Growing or shrinking reallocates the buffers: views of some rows follow at once, so a view kept for later (an
    engine keeps one per batch size) never holds the old buffers alive (a server's idle memory grew by the caches a
    batch size had last seen: issue 52)."""
    cache = KVCache(2, (3, 1, 200, 2), torch.float32, "cpu", grows=True)
    view = cache.rows(0, 2)
    view.layer(1)
    first = [weakref.ref(t) for t in cache.keys + cache.values]
    cache.reserve(150)
    gc.collect()
    assert all(ref() is None for ref in first)
    assert view.layer(1)[0].data_ptr() == cache.layer(1)[0].data_ptr() and view.slots == 192
    grown = [weakref.ref(t) for t in cache.keys + cache.values]
    cache.shrink()
    gc.collect()
    assert all(ref() is None for ref in grown) and view.keys[0].shape == (2, 1, GRANULE, 2)


def test_an_idle_engine_holds_only_its_cache_of_granule_slots(exports, monkeypatch):
    """After batched decoding that grew the cache several times (batch sizes 3, 2, 1 as requests finish; the
    onnxruntime backend's bindings of every shape kept), every buffer the cache ever had is freed but its idle ones
    of GRANULE slots: no binding, view or context holds an old one (issue 52: a server's idle memory 1,265 -> 2,135
    MB over 5 rounds of 4 long prompts; fixed, 696-714 MB over 10 rounds against 676 MB warm). Gemma 3's export: its
    draft head reads three layers' outputs, which the cache holds too."""
    from paradecode.runtime import kvcache
    from paradecode.runtime.engine import Engine, generate_batched

    made = []  # the memory of every buffer: its numpy array (a view of a buffer, or an OrtValue over one, holds it)

    def tracked(cache, slots, *, features=False):
        rows, heads, _, dim = cache._root.shape
        shape = (rows, slots, cache._root.feature_width) if features else (rows, heads, slots, dim)
        memory = np.zeros(shape, dtype=np.float32)
        made.append(weakref.ref(memory))
        return torch.from_numpy(memory)

    folder, _ = exports["gemma3"]
    monkeypatch.setattr(kvcache, "GRANULE", 8)
    monkeypatch.setattr(KVCache, "_new", tracked)
    with load(folder) as model:
        engine = Engine(model.runtime, 3)
        for _ in range(2):
            requests = [
                model.request(prompt_ids=list(range(1, n)), max_new_tokens=new_tokens, ignore_eos=True, mode=mode)
                for n, new_tokens, mode in ((30, 20, "ar"), (12, 9, "paradecode"), (5, 26, "paradecode"))
            ]
            generate_batched(model.runtime, requests, engine=engine)
        gc.collect()
        alive = {ref().ctypes.data for ref in made if ref() is not None}
        current = {t.data_ptr() for t in engine.cache.keys + engine.cache.values + engine.cache.features}
        assert engine.cache.features and len(made) > 4 * len(current)  # it grew, more than once
        assert alive == current and engine.cache.slots == 8
        assert any(b.bound for thread in model.backend._bindings for b in thread.values())  # bindings of caches kept
        engine.free()


def test_buffers_are_allocated_once(exports):
    folder, _ = exports["qwen3"]
    with load(folder, backend="torch") as model:  # a cache that does not grow: fixed addresses
        model.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, thresholds=0.0, ignore_eos=True)
        (engine,) = model._idle  # the call's engine, kept for the next call
        pointers = [t.data_ptr() for t in engine.cache.keys + engine.cache.values]
        model.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, thresholds=0.0, ignore_eos=True)
        assert model._idle == [engine]
        assert [t.data_ptr() for t in engine.cache.keys + engine.cache.values] == pointers
        assert engine.cache.shape == (1, 1, 64, 16) and engine.cache.slots == 64


def test_a_sequence_decodes_across_the_caches_growth_as_it_does_in_a_whole_cache(exports, monkeypatch):
    """The onnxruntime backend's cache grows as the sequence does (its graphs take any length): decoding across
    several growths gives the tokens a cache of every slot from the start gives."""
    from paradecode.runtime import kvcache

    folder, _ = exports["llama"]
    with load(folder) as model:
        settings = dict(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
        monkeypatch.setattr(kvcache, "GRANULE", 8)
        slots = held_slots(monkeypatch)
        grown = [model.generate(**settings, mode=mode) for mode in ("ar", "paradecode")]
        assert max(slots) == 48  # 3 + 40 positions, in steps of 8
        monkeypatch.setattr(kvcache, "GRANULE", 64)
        model._idle.clear()
        whole = [model.generate(**settings, mode=mode) for mode in ("ar", "paradecode")]
    assert [r.token_ids for r in grown] == [r.token_ids for r in whole]
    assert [r.margins for r in grown] == [r.margins for r in whole]


def test_an_engine_starts_each_sequence_in_a_small_cache_again(exports, monkeypatch):
    """A long sequence grows the engine's cache; the next call, alone in the engine, starts from GRANULE slots (every
    call attends over every slot the cache holds) and decodes the tokens a fresh engine gives."""
    from paradecode.runtime import kvcache

    folder, _ = exports["llama"]
    monkeypatch.setattr(kvcache, "GRANULE", 8)
    with load(folder) as model:
        short = dict(prompt_ids=[5, 6, 7], max_new_tokens=4, ignore_eos=True)
        fresh = [model.generate(**short, mode=mode) for mode in ("ar", "paradecode")]
        (engine,) = model._idle
        # plain decoding: the engine's row context, made by the first call, is used across the growth and the shrink
        slots = held_slots(monkeypatch)
        model.generate(prompt_ids=list(range(1, 40)), max_new_tokens=8, ignore_eos=True, mode="ar")
        assert max(slots) == 48  # 39 + 8 positions, in steps of 8
        assert model._idle == [engine] and engine.cache.slots == 8  # idle, it holds no slots a sequence grew it to
        again = [model.generate(**short, mode=mode) for mode in ("ar", "paradecode")]
        assert model._idle == [engine] and engine.cache.slots == 8  # 3 + 4 positions
    assert [r.token_ids for r in again] == [r.token_ids for r in fresh]
    assert [r.margins for r in again] == [r.margins for r in fresh]
    growing = KVCache(2, (2, 1, 40, 2), torch.float32, "cpu", grows=True)
    growing.reserve(30)
    growing.written(1, 30)
    growing.shrink()
    assert growing.slots == 8 and growing.generation == 2 and growing.lengths == [0, 0]
    fixed = KVCache(2, (2, 1, 40, 2), torch.float32, "cpu")
    fixed.shrink()  # a cache that does not grow keeps its buffers (CUDA graphs and engines bind their addresses)
    assert fixed.slots == 40 and fixed.generation == 0


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
