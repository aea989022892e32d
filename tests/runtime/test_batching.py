"""Continuous batching (runtime/engine.py): requests decoded together equal each request decoded alone.

Every family's tiny export (trained random heads, fused exits; max_batch 8, the default) on both CPU backends:
requests of different prompt lengths and budgets join a batch of fewer rows than requests, so rows fill, leave
and are refilled mid-run (the last row moving into a freed one). A `paradecode` request alone in its batch decodes
with ParaDecode (thresholds 0: every token exits, most roll back), hands over to batched calls when another joins,
and takes ParaDecode back when it is alone again: its tokens must not change.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import load
from paradecode.runtime.engine import ALONE, TOGETHER, Engine, Sequence, generate_batched
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.model import StreamedToken
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult
from tests.tiny_models import TINY_CONFIGS

BACKENDS = ("onnxruntime", "torch")
# (prompt length, new tokens): different lengths, so rows sit at different positions in every batched call
SHAPES = ((5, 20), (11, 9), (3, 30), (8, 14), (17, 25))


def prompts_of(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length, _ in SHAPES]


def requests_of(model, *, seeded: bool = False, **settings):
    """A request of each of SHAPES' prompts with `settings` (and, `seeded`, the i-th with seed i)."""
    prompts = prompts_of(model.manifest.spec.vocab_size)
    return [
        model.request(
            prompt_ids=ids, max_new_tokens=new, ignore_eos=True, **settings, **({"seed": i} if seeded else {})
        )
        for i, (ids, (_, new)) in enumerate(zip(prompts, SHAPES))
    ]


def decoded_alone(model, request):
    """`request` decoded alone: in an engine of one row, as `model.generate` decodes."""
    return generate_batched(model.runtime, [request])[0]


def alone(model, requests):
    return [decoded_alone(model, r).token_ids for r in requests]


class Collect:
    """A sequence's sink: its streamed tokens, then its result (or error)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.end = None

    def __call__(self, event) -> None:
        if isinstance(event, StreamedToken):
            assert self.end is None, "a token after the end"
            self.tokens.append(event.token)
        else:
            assert self.end is None, "two ends"
            self.end = event


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_batched_greedy_equals_each_request_alone(loaded, family, backend):
    model = loaded[family, backend]
    for settings in ({"mode": "ar"}, {"mode": "paradecode", "thresholds": 0.0, "max_unverified": 3}):
        requests = requests_of(model, **settings)
        want = alone(model, requests)
        got = generate_batched(model.runtime, requests, rows=3)
        assert [r.token_ids for r in got] == want, settings
        assert [r.stats.stop_reason for r in got] == ["max_new_tokens"] * len(requests)
        assert [r.stats.new_tokens for r in got] == [new for _, new in SHAPES]
        assert [r.stats.prompt_tokens for r in got] == [length for length, _ in SHAPES]


def test_batched_sampling_draws_what_each_request_draws_alone(loaded):
    """Draws are keyed by (seed, position): plain decoding samples the same tokens in a batch as alone."""
    model = loaded["llama", "onnxruntime"]
    requests = requests_of(model, mode="ar", temperature=0.9, top_p=0.9, seeded=True)
    got = generate_batched(model.runtime, requests, rows=4)
    assert [r.token_ids for r in got] == alone(model, requests)
    assert [r.stats.seed for r in got] == list(range(len(requests)))
    greedy = generate_batched(model.runtime, requests_of(model, mode="ar"), rows=4)
    assert [r.token_ids for r in got] != [r.token_ids for r in greedy]  # it did sample


@pytest.mark.parametrize("temperature", [1e-320, 1e-308, 1e-300, 1e-30])
def test_a_temperature_too_small_to_divide_by_is_greedy_in_a_batch(loaded, temperature):
    """A seeded temperature near 0 gives each row the greedy answer, plain and ParaDecode (runtime/sampling.py)."""
    model = loaded["llama", "onnxruntime"]
    for settings in ({"mode": "ar"}, {"mode": "paradecode", "thresholds": 0.0, "max_unverified": 3}):
        greedy = alone(model, requests_of(model, mode="ar"))
        requests = requests_of(model, **settings, temperature=temperature, seeded=True)
        got = generate_batched(model.runtime, requests, rows=4)
        assert [r.token_ids for r in got] == greedy, (temperature, settings)


def repeating_requests(model, count: int, **settings):
    """Requests whose prompts repeat a pattern (lookup proposes at every step), of different lengths."""
    vocab = model.manifest.spec.vocab_size
    patterns = [[(7 * i + 3 * j) % vocab for j in range(4 + i)] for i in range(count)]
    return [
        model.request(prompt_ids=(pattern * 4)[: 9 + 3 * i], max_new_tokens=24, ignore_eos=True, **settings)
        for i, pattern in enumerate(patterns)
    ]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_paradecode_rows_verify_their_proposals_in_the_batchs_calls(loaded, sampled, monkeypatch):
    """In a batch, each `paradecode` row's lookup proposals go through the batch's calls with the other rows' tokens
    and are verified there: lookup proposes, and every output is its request's alone (a seed's draws too).

    The batch takes every proposal: how many the measured costs let through depends on the machine's timing (CI's
    run on 2026-12-06 took only the 25 that were all accepted), and this test is about verifying them, not about
    that policy (tests/runtime/test_speculation.py)."""
    monkeypatch.setattr(Speculation, "batch_proposals", lambda self, available, sources=None: max(available, default=0))
    model = loaded["llama", "onnxruntime"]
    settings = dict(temperature=0.3, seed=5) if sampled else {}
    lookup = dict(lookup_tokens=4, lookup_min_ngram=2)
    paradecode = repeating_requests(model, 4, mode="paradecode", **lookup, **settings)
    plain = repeating_requests(model, 4, mode="ar", **lookup, **settings)
    batch = Engine(model.runtime, 4)
    results = [Collect() for _ in paradecode]
    sequences = [Sequence.of(request, sink, model.runtime) for request, sink in zip(paradecode, results)]
    for sequence in sequences:
        batch.join(sequence)
    while batch.size == 4:
        batch.step()
    assert batch.steps[ALONE] == 0  # several rows: every step together
    proposed = sum(s.stats.lookup_proposed for s in sequences)  # in the batch's steps alone
    accepted = sum(s.stats.lookup_accepted for s in sequences)
    assert 0 < accepted < proposed, "lookup's proposals were not both accepted and rejected: the test tests little"
    while batch.size:
        batch.step()
    assert [r.tokens for r in results] == alone(model, paradecode) == alone(model, plain)
    if sampled:  # it did sample
        greedy = repeating_requests(model, 4, mode="paradecode", **lookup)
        assert [r.tokens for r in results] != alone(model, greedy)


def test_a_request_hands_paradecode_over_and_takes_it_back(loaded):
    """Alone: ParaDecode steps (exits, rollbacks); another joins: batched calls from its newest token; alone again:
    a new decoder resumes without a prefill. Both outputs equal their requests alone."""
    model = loaded["qwen2", "onnxruntime"]
    first, second = requests_of(model, mode="paradecode", thresholds=0.0)[2:4]  # 14 new tokens for the second
    # the first long enough to outlast the second even where its lookup proposals (2 a step) are all accepted in
    # the batch: it hands over with an executor's verified tokens it never received, and takes ParaDecode back
    new = model.capacity - len(first.ids) - 1
    assert new > 6 + 13 * 3
    first = model.request(
        prompt_ids=first.ids, max_new_tokens=new, ignore_eos=True, mode="paradecode", thresholds=0.0, lookup_tokens=2
    )
    want = alone(model, [first, second])
    batch = Engine(model.runtime, 2)
    a, b = Collect(), Collect()
    batch.join(Sequence.of(first, a, model.runtime))
    for _ in range(5):
        batch.step()
    assert batch.steps == {ALONE: 5, TOGETHER: 0} and len(a.tokens) == 6
    assert batch.sequences[0].decoder is not None  # ParaDecode running
    batch.join(Sequence.of(second, b, model.runtime))
    while batch.size == 2:
        batch.step()
    # at most a step a token of the second's 13 after its prefill's (fewer where lookup proposals were accepted)
    assert 0 < batch.steps[TOGETHER] <= 13 and a.end is None and isinstance(b.end, GenerationResult)
    while batch.size:
        batch.step()
    assert batch.steps[ALONE] > 5
    assert a.tokens == want[0] == a.end.token_ids and b.tokens == want[1] == b.end.token_ids
    assert sum(a.end.stats.exits_per_layer.values()) > 0  # it did speculate, before and after the batched calls
    assert a.end.stats.rollbacks > 0


@pytest.mark.parametrize("end", ["eos", "max_seq_len"])
def test_a_request_taken_back_by_paradecode_stops_where_it_would_alone(loaded, monkeypatch, end):
    """The resumed decoder decides the stop by the request's own `Stops` (positions counted from its prompt): an
    EOS it meets after the hand-back, or the cache's end, exactly where the request alone stops."""
    model = loaded["qwen2", "onnxruntime"]
    capacity, vocab = model.capacity, model.manifest.spec.vocab_size
    other = requests_of(model, mode="paradecode", thresholds=0.0)[3]  # 14 new tokens
    # lookup off for the first: one token a step in the batch, so its stop comes after the hand-back
    if end == "max_seq_len":  # room for 31 tokens: 6 alone, 14 together, the rest alone again
        first = model.request(
            prompt_ids=[i % vocab for i in range(capacity - 30)],
            max_new_tokens=200,
            ignore_eos=True,
            mode="paradecode",
            thresholds=0.0,
            lookup_tokens=0,
        )
    else:
        # the first request whose output (40 tokens) meets a token for the first time after the hand-back
        settings = dict(max_new_tokens=40, ignore_eos=True, mode="paradecode", thresholds=0.0, lookup_tokens=0)
        requests = [model.request(prompt_ids=ids, **settings) for ids in prompts_of(vocab)]
        late = [
            (request, tokens, next(i for i in range(22, len(tokens)) if tokens[i] not in tokens[:i]))
            for request, tokens in zip(requests, alone(model, requests))
            if any(tokens[i] not in tokens[:i] for i in range(22, len(tokens)))
        ]
        assert late, "no output meets a new token late: pick other prompts"
        free, tokens, k = late[0]
        monkeypatch.setattr(model, "facts", dataclasses.replace(model.facts, eos=(tokens[k],)))
        first = model.request(prompt_ids=free.ids, **{**settings, "ignore_eos": False})
    want = decoded_alone(model, first)
    assert want.stats.stop_reason == end
    batch, a, b = Engine(model.runtime, 2), Collect(), Collect()
    batch.join(Sequence.of(first, a, model.runtime))
    for _ in range(5):
        batch.step()
    batch.join(Sequence.of(other, b, model.runtime))
    while batch.size == 2:
        batch.step()
    assert a.end is None  # it goes on alone: ParaDecode takes it back
    while batch.size:
        batch.step()
    assert batch.steps[ALONE] > 5 and len(a.tokens) > 20
    assert a.tokens == want.token_ids == a.end.token_ids and a.end.stats.stop_reason == end


def test_a_waiting_request_keeps_a_lone_one_from_speculating(loaded):
    model = loaded["llama", "onnxruntime"]
    request = requests_of(model, mode="paradecode", thresholds=0.0)[0]
    batch = Engine(model.runtime, 2)
    batch.join(Sequence.of(request, Collect(), model.runtime))
    batch.step(waiting=True)
    assert batch.steps == {ALONE: 0, TOGETHER: 1} and batch.sequences[0].decoder is None


def test_stops_and_cancellation_touch_only_their_own_rows(loaded):
    model = loaded["llama", "onnxruntime"]
    requests = requests_of(model, mode="ar")
    want = alone(model, requests)
    eos = want[1][4]  # made an end-of-sequence token below: the second request stops at its first occurrence
    facts = model.facts
    model.facts = dataclasses.replace(facts, eos=(eos,))  # the model's end-of-sequence token, for this request
    try:
        stopped = model.request(prompt_ids=requests[1].ids, max_new_tokens=SHAPES[1][1], mode="ar")
    finally:
        model.facts = facts
    sinks = [Collect() for _ in requests]
    cancel_after = 3
    batch = Engine(model.runtime, len(requests))
    cancelled = lambda: len(sinks[0].tokens) >= cancel_after
    batch.join(Sequence.of(requests[0], sinks[0], model.runtime, cancelled=cancelled))
    batch.join(Sequence.of(stopped, sinks[1], model.runtime))
    for request, sink in zip(requests[2:], sinks[2:]):
        batch.join(Sequence.of(request, sink, model.runtime))
    while batch.size:
        batch.step()
    first = want[1].index(eos)
    assert sinks[1].tokens == want[1][: first + 1] and sinks[1].end.stats.stop_reason == "eos"
    assert sinks[0].tokens == want[0][:cancel_after] and sinks[0].end.stats.stop_reason == "cancelled"
    for sink, tokens in zip(sinks[2:], want[2:]):
        assert sink.tokens == tokens and sink.end.stats.stop_reason == "max_new_tokens"


def test_a_full_cache_ends_only_its_request(loaded):
    model = loaded["llama", "onnxruntime"]
    capacity = model.manifest.max_seq_len
    vocab = model.manifest.spec.vocab_size
    long = model.request(prompt_ids=[i % vocab for i in range(capacity - 3)], max_new_tokens=50, ignore_eos=True)
    short = requests_of(model, mode="ar")[2]
    got = generate_batched(model.runtime, [long, short], rows=2)
    assert got[0].stats.stop_reason == "max_seq_len" and len(got[0].token_ids) == 4
    assert got[0].token_ids == decoded_alone(model, long).token_ids
    assert got[1].token_ids == alone(model, [short])[0]


def test_a_failing_prefill_fails_only_its_request(loaded, monkeypatch):
    model = loaded["llama", "onnxruntime"]
    requests = requests_of(model, mode="ar")[:3]
    want = alone(model, requests)
    batch = Engine(model.runtime, 3)
    sinks = [Collect() for _ in requests]
    batch.join(Sequence.of(requests[0], sinks[0], model.runtime))
    real = model.backend.run

    def broken(name, feeds, lane, outputs=None):
        if feeds[next(iter(feeds))].shape[1] == len(requests[1].ids):  # the second prompt's prefill
            raise RuntimeError("the device fell over")
        return real(name, feeds, lane, outputs)

    monkeypatch.setattr(model.backend, "run", broken)
    batch.join(Sequence.of(requests[1], sinks[1], model.runtime))
    monkeypatch.setattr(model.backend, "run", real)
    batch.join(Sequence.of(requests[2], sinks[2], model.runtime))
    while batch.size:
        batch.step()
    assert isinstance(sinks[1].end, RuntimeError) and sinks[1].tokens == []
    assert sinks[0].tokens == want[0] and sinks[2].tokens == want[2]


def test_rows_are_views_and_a_moved_row_keeps_its_positions():
    cache = KVCache(2, (3, 1, 8, 2), torch.float32, "cpu")
    for buffer in (*cache.keys, *cache.values):
        buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32).view(buffer.shape))
    before = [k[2].clone() for k in cache.keys]
    rows = cache.rows(1, 3)
    assert rows.shape == (2, 1, 8, 2) and rows.keys[0].data_ptr() == cache.keys[0][1].data_ptr()
    cache.move_row(2, 0, 5)
    for key, old in zip(cache.keys, before):
        assert torch.equal(key[0, :, :5], old[:, :5]) and not torch.equal(key[0, :, 5:], old[:, 5:])
    assert cache.batch == 3 and rows.batch == 2


def test_a_batch_needs_an_export_with_rows(stories_dir, tmp_path):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path / "one-row"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=out, max_seq_len=32, max_batch=1))
    with load(out) as model:
        with pytest.raises(UserInputError, match=r"exported with --max-batch 1\. Re-export it"):
            Engine(model.runtime, 2)
        with pytest.raises(UserInputError, match="positive number of rows"):
            Engine(model.runtime, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_a_row_has_not_reached_never_reach_its_output(loaded, backend):
    """A batched call reads every slot of every row (masked): a short row decodes beside a long one, its cache
    past what it wrote holding large numbers, and gets the tokens it gets alone."""
    model = loaded["gpt2", backend]
    short, long = requests_of(model, mode="ar")[2], requests_of(model, mode="ar")[4]
    want = alone(model, [short, long])
    batch = Engine(model.runtime, 2)
    batch.cache.reserve(batch.cache.shape[2])
    for layer in range(1, batch.cache.num_layers + 1):
        for buffer in batch.cache.layer(layer):
            buffer.fill_(1e4)
    sinks = [Collect(), Collect()]
    batch.join(Sequence.of(long, sinks[1], model.runtime))
    batch.join(Sequence.of(short, sinks[0], model.runtime))
    while batch.size:
        batch.step()
    assert [sinks[0].tokens, sinks[1].tokens] == want


def test_a_batch_remembers_outputs_for_shared_lookup(loaded):
    model = loaded["llama", "onnxruntime"]
    model.shared_index.clear()
    try:
        plain = requests_of(model, mode="paradecode", thresholds=float("inf"))
        shared = requests_of(model, mode="paradecode", thresholds=float("inf"), lookup_shared=True)
        want = alone(model, plain)
        assert len(model.shared_index) == 0  # requests without lookup_shared leave nothing behind
        first = generate_batched(model.runtime, shared, rows=2)
        assert len(model.shared_index) > 0
        again = generate_batched(model.runtime, shared, rows=2)
        assert [r.token_ids for r in first] == [r.token_ids for r in again] == want
    finally:
        model.shared_index.clear()


def test_a_request_joining_after_the_weights_changed_fails_before_reading_them(loaded, monkeypatch):
    """A request joining after the export's folder changed (runtime/watched.py) is refused before its prefill."""
    from paradecode.graphs.errors import ExportChangedError

    model = loaded["llama", "onnxruntime"]
    request = requests_of(model, mode="ar")[0]
    batch, sink = Engine(model.runtime, 2), Collect()

    def changed():
        raise ExportChangedError("the weights changed on disk")

    monkeypatch.setattr(model.files, "check", changed)
    monkeypatch.setattr(model.backend, "run", lambda *args, **kwargs: pytest.fail("the weights were read"))
    batch.join(Sequence.of(request, sink, model.runtime))
    assert isinstance(sink.end, ExportChangedError) and sink.tokens == [] and batch.size == 0


def test_an_error_setting_a_request_up_fails_it_alone(loaded, monkeypatch):
    from paradecode.runtime import engine as batching

    model = loaded["llama", "onnxruntime"]
    first, second = requests_of(model, mode="ar")[:2]
    want = alone(model, [first])[0]
    batch, sinks = Engine(model.runtime, 2), [Collect(), Collect()]
    batch.join(Sequence.of(first, sinks[0], model.runtime))
    real = batching.prefill

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the set-up")

    monkeypatch.setattr(batching, "prefill", broken)
    batch.join(Sequence.of(second, sinks[1], model.runtime))
    monkeypatch.setattr(batching, "prefill", real)
    assert isinstance(sinks[1].end, RuntimeError) and batch.size == 1
    while batch.size:
        batch.step()
    assert sinks[0].tokens == want and generate_batched(model.runtime, []) == []
