"""One decoding contract: plain decoding (an engine's steps) and ParaDecode each take a request's `Stops` (an
end-of-sequence token, `max_new_tokens`, the KV cache's end), decide after every verified token and end there by
themselves; the model adds only what text shows (stop strings)."""

from __future__ import annotations

import dataclasses

import pytest

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime import load
from paradecode.runtime.config import NEVER
from paradecode.runtime.decoding import DecodeContext
from paradecode.runtime.engine import Engine, Sequence, StreamedToken, executor_of
from paradecode.runtime.planner import Planner
from paradecode.runtime.proposers import LookupProposer
from paradecode.runtime.stats import LOOKUP, GenerationResult, GenerationStats
from paradecode.runtime.stops import EOS, MAX_NEW_TOKENS, MAX_SEQ_LEN, STOP_STRING, Completion, Stops
from paradecode.runtime.tracing import Timeline


def decode_plainly(model, request) -> list[tuple[int, float, str | None]]:
    """Plain decoding of `request` by an engine of one row stepped to its end, as (token, margin, stop) after each
    token: the engine decides the stops (the sequence leaves at the first) and hands the reason over in the result,
    after the last token; each step gives one token, and none is made after the stop."""
    events = []
    engine = Engine(model.runtime, 1)
    engine.join(Sequence.of(request, events.append, model.runtime, with_text=False))
    steps = 0
    while engine.size:
        engine.step()
        steps += 1
    *tokens, result = events
    assert all(isinstance(e, StreamedToken) for e in tokens) and isinstance(result, GenerationResult), events
    assert steps == len(tokens) - 1  # the prefill gave the first
    stops = [None] * (len(tokens) - 1) + [result.stats.stop_reason]
    return [(e.token, margin, stop) for e, margin, stop in zip(tokens, result.margins, stops)]


def executor(model, request, ctx, history, stats):
    """ParaDecode's executor of `request` over `ctx` after `history`, with the request's own lookup."""
    lookup = LookupProposer(request.lookup) if request.lookup is not None else None
    return executor_of(model.runtime, request, ctx, history, stats, lookup=lookup)


def test_stops_by_position():
    stops = Stops(prompt_tokens=4, max_new_tokens=3, eos=frozenset({2}), capacity=10)
    assert [stops.after(7, p) for p in (4, 5, 6)] == [None, None, MAX_NEW_TOKENS]  # the 3rd new token is at 6
    assert stops.after(2, 4) == EOS and stops.after(2, 6) == EOS  # an EOS outranks the budget
    assert stops.last_position == 6
    full = Stops(prompt_tokens=4, max_new_tokens=100, eos=frozenset(), capacity=10)
    assert full.after(7, 9) is None and full.after(7, 10) == MAX_SEQ_LEN  # slot 9 is the cache's last
    assert full.last_position == 10
    assert Stops.room(4, 10) == 7  # new tokens at positions 4..10: the one at 10 is never stored
    assert Stops.room(10, 10) == 1 and Stops.room(11, 10) == 0


def test_a_stop_string_outranks_only_a_full_cache():
    class Letters:  # one character per token
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    for decoder_stop, want in ((None, STOP_STRING), (MAX_SEQ_LEN, STOP_STRING), (EOS, EOS), (MAX_NEW_TOKENS, None)):
        completion = Completion([0], ("bc",), Letters(), with_text=True)
        assert completion.push(1, 0.0, None) == ("b", "", None)  # "b" may begin the stop string: not shown yet
        piece, shown, stop = completion.push(2, 0.0, decoder_stop)
        assert piece == "c" and stop == (want or decoder_stop), decoder_stop
        assert (
            shown == "" and completion.stop_string == "bc" and completion.shown.result == ""
        )  # found whatever stopped
    completion = Completion([0], ("bd",), Letters(), with_text=True)
    assert completion.push(1, 0.0, None) == ("b", "", None)
    assert completion.push(2, 0.0, MAX_NEW_TOKENS) == ("c", "bc", MAX_NEW_TOKENS)  # what was held back goes last
    assert completion.stop_string is None and completion.shown.result == "bc"


@pytest.mark.parametrize("mode", ["ar", "paradecode"])
@pytest.mark.parametrize(
    ("max_new_tokens", "capacity_left", "reason"),
    [(7, None, MAX_NEW_TOKENS), (1, None, MAX_NEW_TOKENS), (400, 5, MAX_SEQ_LEN)],
)
def test_each_decoder_ends_by_itself_where_its_stops_say(stories_export, mode, max_new_tokens, capacity_left, reason):
    """Consumed to its end, with nobody closing it, each decoder yields exactly the tokens up to its stop, says why
    after the last one, and nothing after: what `generate` returns, stop reason included."""
    with load(stories_export[0]) as model:
        capacity = model.capacity
        prompt = list(range(3, 3 + (capacity - capacity_left if capacity_left else 5)))
        settings = dict(max_new_tokens=max_new_tokens, ignore_eos=True, thresholds=0.0, overlap="batched")
        want = model.generate(prompt_ids=prompt, mode=mode, **settings)
        request = model.request(prompt_ids=prompt, mode=mode, **settings)
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
        stats = GenerationStats(mode)
        if mode == "ar":
            yielded = decode_plainly(model, request)
        else:
            decoder = executor(model, request, ctx, prompt, stats).run()
            yielded = list(decoder)  # to its end: nobody closes it
    assert [t for t, _, _ in yielded] == want.token_ids
    assert len(yielded) == (max_new_tokens if reason == MAX_NEW_TOKENS else capacity - len(prompt) + 1)
    assert [s for _, _, s in yielded] == [None] * (len(yielded) - 1) + [reason]
    assert want.stats.stop_reason == reason
    if mode == "paradecode":  # it counts into the stats it is given, as generate's
        assert stats.exits_per_layer == want.stats.exits_per_layer and stats.rollbacks == want.stats.rollbacks
        assert bool(stats.exits_per_layer) == (max_new_tokens > 1)


@pytest.mark.parametrize("mode", ["ar", "paradecode"])
def test_each_decoder_stops_at_an_end_of_sequence_token(stories_export, mode, monkeypatch):
    with load(stories_export[0]) as model:
        free = model.generate(prompt_ids=[1], max_new_tokens=40, mode=mode, ignore_eos=True, thresholds=0.0)
        eos = free.token_ids[9]  # made the end-of-sequence token: decoding stops at its first occurrence
        monkeypatch.setattr(model, "facts", dataclasses.replace(model.facts, eos=(eos,)))
        request = model.request(prompt_ids=[1], max_new_tokens=40, mode=mode, thresholds=0.0)
        stopped = model.generate(prompt_ids=[1], max_new_tokens=40, mode=mode, thresholds=0.0)
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
        if mode == "ar":
            yielded = decode_plainly(model, request)
        else:
            decoder = executor(model, request, ctx, [1], GenerationStats(mode)).run()
            yielded = list(decoder)
    first = free.token_ids.index(eos)
    assert [t for t, _, _ in yielded] == free.token_ids[: first + 1] == stopped.token_ids
    assert yielded[-1][2] == EOS and all(s is None for _, _, s in yielded[:-1])
    assert stopped.stats.stop_reason == EOS


@pytest.mark.parametrize("thresholds", [NEVER, 0.0], ids=["lookup alone", "every token may exit"])
def test_a_proposal_ending_with_the_eos_ends_the_output_there(stories_export, monkeypatch, thresholds):
    """Lookup proposes the right continuation up to and including the EOS; ParaDecode starts nothing after it:
    no exit from the proposed EOS, no proposal past it once the final layer accepts it (before, it proposed again
    past the end and counted those tokens, and with exits on it guessed and rolled back past it)."""
    with load(stories_export[0]) as model:
        prompt = [1, 5, 9, 13]
        free = model.generate(prompt_ids=prompt, max_new_tokens=20, mode="ar", ignore_eos=True).token_ids
        k = next(i for i in range(3, 20) if free[i] not in free[:i])  # its first occurrence
        eos, starts, asked = free[k], [], []
        propose, start_frontier = Planner.propose, Planner.start_frontier

        def proposing_the_rest(self, position):
            asked.append(position)
            propose(self, position)
            return (list(free[1 : k + 1]) if position == len(prompt) else []), LOOKUP

        def recording(self, position, token):
            starts.append(position)
            return start_frontier(self, position, token)

        monkeypatch.setattr(Planner, "propose", proposing_the_rest)
        monkeypatch.setattr(Planner, "start_frontier", recording)
        monkeypatch.setattr(model, "facts", dataclasses.replace(model.facts, eos=(eos,)))
        result = model.generate(
            prompt_ids=prompt, max_new_tokens=20, thresholds=thresholds, lookup_tokens=8, max_unverified=8
        )
    assert result.token_ids == free[: k + 1] and result.stats.stop_reason == EOS
    assert result.stats.lookup_proposed == k and result.stats.lookup_accepted == k
    assert starts == [len(prompt)] and asked == [len(prompt)]
    assert result.stats.exits_per_layer == {} and result.stats.rollbacks == 0


def test_paradecode_ending_without_a_stop_decision_is_a_bug_it_reports(stories_export):
    class NeverSays(Stops):  # a budget of 5 tokens that never says it is spent
        def after(self, token, position):
            return None

    with load(stories_export[0]) as model:
        request = model.request(prompt_ids=[1, 2], max_new_tokens=5, ignore_eos=True, thresholds=0.0)
        request = dataclasses.replace(request, stops=NeverSays(2, 5, frozenset(), model.capacity))
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
        decoder = executor(model, request, ctx, [1, 2], GenerationStats("x"))
        with pytest.raises(SchedulerStallError, match="without a stop decision"):
            list(decoder.run())
