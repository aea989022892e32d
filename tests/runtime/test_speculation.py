"""Adaptive speculation (runtime/speculation.py): costs learned from the decoder's own calls, the decisions the
cost model gives, exploration, when it is on, and that it never changes the output."""

import math

import pytest

from paradecode.export.heads.cost_model import CostModel
from paradecode.graphs.errors import UserInputError
from paradecode.runtime import load
from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.speculation import EXPLORE, LEARN_TOKENS, OUTLIER, CallTimes, Speculation
from paradecode.runtime.stats import DRAFT, LOOKUP

MS = 1e-3


def warmed(times: CallTimes, *names: str) -> CallTimes:
    """`times` after a first call of each of `names`, which is never learned from (it may create the session)."""
    for name in names:
        times.observe(name, 1, 9.0)
    return times


def test_call_times_learn_per_layer_and_per_position_costs():
    times = warmed(CallTimes(), "layer_3", "segment_4_7", "final", "exit_4", "layer_exit_8")
    assert times.layer.value is None and not times.known  # the first calls taught nothing
    times.observe("layer_3", 1, 1 * MS)
    times.observe("segment_4_7", 1, 4 * MS)  # four layers: 1 ms each
    assert times.layer.value == pytest.approx(1 * MS)
    times.observe("segment_4_7", 3, 6 * MS)  # 1.5 ms a layer at 3 positions: 0.25 ms per further position
    assert times.layer_extra.value == pytest.approx(0.25 * MS)
    times.observe("final", 1, 2 * MS)
    times.observe("final", 2, 3 * MS)
    assert (times.final.value, times.final_extra.value) == pytest.approx((2 * MS, 1 * MS))
    times.observe("exit_4", 1, 0.5 * MS)
    times.observe("layer_exit_8", 1, 1.3 * MS)  # a layer and its head: the head's share is 0.3 ms
    assert times.exit_head[4].value == pytest.approx(0.5 * MS)
    assert times.exit_head[8].value == pytest.approx(0.3 * MS)
    times.observe("embed", 1, 9.0)  # not part of the model
    times.observe("something_else", 1, 9.0)
    times.observe("segment_4_7", LEARN_TOKENS + 1, 9.0)  # a prefill: not a decoding step's cost
    assert times.layer.value == pytest.approx(1 * MS) and times.known
    times.observe("layer_3", 1, 1.0)  # a preempted call counts as OUTLIER times the estimate at most
    assert times.layer.value == pytest.approx(0.97 * MS + 0.03 * OUTLIER * MS)


def costs(speculation: Speculation, layer=1 * MS, layer_2=1.1 * MS, final=3 * MS, final_2=3.2 * MS, head=0.5 * MS):
    warmed(speculation.times, "layer_1", "final", "exit_4")
    for name, tokens, seconds in [
        ("layer_1", 1, layer),
        ("layer_1", 2, layer_2),
        ("final", 1, final),
        ("final", 2, final_2),
        ("exit_4", 1, head),
    ]:
        speculation.times.observe(name, tokens, seconds)


def test_exits_that_are_accepted_pay_and_rejected_ones_do_not():
    speculation = Speculation(num_layers=12)
    assert speculation.exit_gain(4) is None and speculation.try_exit(4)  # costs unknown: try
    costs(speculation)
    for _ in range(40):
        speculation.head_called(4, exited=True)
        speculation.verified(4, accepted=True)
    # the cost model of the calibration and the bench (export/heads/cost_model.py), in layer calls: calling the head at
    # layer 4 for every token against plain decoding, at the shares this model estimates
    rates = speculation.exit_rates[4]
    exits, accepted = rates.exits.value, rates.accepted.value
    model = CostModel(12, head=0.5, merge=0.1, final=3.0, final_merge=0.2)
    per_token = model.per_token({4: exits}, [4], wrong={4: exits * (1 - accepted)})
    gain = speculation.exit_gain(4)
    assert gain == pytest.approx((model.ar() - per_token) * MS)
    assert gain > 0 and speculation.try_exit(4)
    for _ in range(60):
        speculation.head_called(4, exited=True)
        speculation.verified(4, accepted=False)
    assert speculation.exit_gain(4) < 0
    decisions = [speculation.try_exit(4) for _ in range(2 * EXPLORE)]
    assert decisions.count(True) == 2 and decisions[EXPLORE - 1] and decisions[-1]  # explored, then skipped


def test_an_exit_head_that_is_the_final_head_costs_what_the_final_head_costs():
    speculation = Speculation(num_layers=12)
    costs(speculation)
    assert speculation.exit_gain(4, head_is_final=True) == pytest.approx(speculation.exit_gain(4) + (0.5 - 3) * MS)


def test_lookup_proposes_as_many_tokens_as_pay():
    speculation = Speculation(num_layers=12)
    assert speculation.lookup_length(5) is None and speculation.lookup_tokens(5) == 5  # costs unknown: propose
    costs(speculation, layer_2=1.5 * MS, final_2=5 * MS)  # a further position: 0.5 ms a layer, 2 ms the head
    token, extra = (12 * 1 + 3) * MS, (12 * 0.5 + 2) * MS  # a token's pass; what one more position adds
    for _ in range(50):  # the first two tokens of a proposal are always accepted, the third never
        for depth, accepted in ((1, True), (2, True), (3, False)):
            speculation.verified(LOOKUP, accepted, depth)
    rates = [speculation.lookup_depth[d].value for d in range(3)]
    assert rates[0] * rates[1] * token > extra and rates[0] * rates[1] * rates[2] * token < extra
    assert speculation.lookup_length(5) == 2 and speculation.lookup_length(1) == 1
    for _ in range(100):  # now the first is never accepted: no token pays
        speculation.verified(LOOKUP, False, 1)
    assert speculation.lookup_length(5) == 0
    proposed = [speculation.lookup_tokens(5) for _ in range(2 * EXPLORE)]
    assert proposed.count(5) == 2 and proposed[EXPLORE - 1] == 5 and proposed.count(0) == 2 * EXPLORE - 2


def test_the_draft_head_drafts_as_many_guesses_as_pay_their_drafting_too():
    """A guess costs its draft call whether or not it is accepted: the chain drafted is the longest whose last guess
    saves more than its verifying position and its draft call; none where the first does not pay (the draft head
    is then not called), but every EXPLORE-th chain that would be cut is drafted whole."""
    speculation = Speculation(num_layers=12)
    assert speculation.draft_length(3) is None and speculation.draft_tokens(3) == 3  # costs unknown: draft
    costs(speculation, layer_2=1.5 * MS, final_2=5 * MS)
    assert speculation.draft_length(3) is None  # the draft call's cost not known yet
    warmed(speculation.times, "draft")
    speculation.times.observe("draft", 1, 2 * MS)
    speculation.times.observe("draft", 4, 50 * MS)  # a feed of several positions: not a chain's step
    speculation.times.observe("draft_reduce", 1, 50 * MS)  # its map: not learned as a step
    assert speculation.times.draft.value == pytest.approx(2 * MS)
    token, extra = (12 * 1 + 3) * MS, (12 * 0.5 + 2 + 2) * MS  # a token's pass; a guess's position and draft call
    for _ in range(60):  # the first guess accepted 5 times in 6, the second after it 3 in 4, the third never
        for i in range(6):
            speculation.verified(DRAFT, i < 5, 1)
        for i in range(4):
            speculation.verified(DRAFT, i < 3, 2)
        speculation.verified(DRAFT, False, 3)
    rates = [speculation.draft_depth[d].value for d in range(3)]
    assert rates[0] * token > extra and rates[0] * rates[1] * token < extra  # without its draft call it would pay:
    assert rates[0] * rates[1] * token > extra - 2 * MS
    assert speculation.draft_length(3) == 1 and not speculation.lookup_depth  # lookup's rates untouched
    for _ in range(100):  # now no guess is accepted: none is drafted
        speculation.verified(DRAFT, False, 1)
    assert speculation.draft_length(3) == 0
    drafted = [speculation.draft_tokens(3) for _ in range(2 * EXPLORE)]
    assert drafted.count(3) == 2 and drafted[EXPLORE - 1] == 3 and drafted.count(0) == 2 * EXPLORE - 2


def test_a_batch_takes_fewer_proposals_as_it_fills():
    """A batch step pads every row to its fullest's positions: the proposals a row may take fall as rows are added
    (one row with proposals among seven without pays for 7 padded rows), and rise with their acceptance."""
    speculation = Speculation(num_layers=12)
    assert speculation.batch_proposals([5, 0, 0]) == 5  # costs unknown: every proposal
    costs(speculation, layer_2=1.2 * MS, final_2=3.5 * MS)  # a further position: 0.2 ms a layer, 0.5 ms the head
    for _ in range(60):  # the first three tokens of a proposal always accepted, the rest never
        for depth in range(1, 6):
            speculation.verified(LOOKUP, depth <= 3, depth)
    alone, full = speculation.batch_proposals([5]), speculation.batch_proposals([5] * 8)
    assert alone >= full and speculation.batch_proposals([5, 0, 0, 0, 0, 0, 0, 0]) <= full
    assert alone == 3  # past the third token nothing is accepted: no further position pays
    assert speculation.batch_proposals([0, 0]) == 0


def test_a_batch_weighs_each_rows_proposals_by_their_sources_acceptance():
    """Rows proposing the draft head's guesses are weighed by its depth rates, lookup's by lookup's: the same
    available counts take more where the source's guesses are accepted."""
    speculation = Speculation(num_layers=12)
    costs(speculation, layer_2=1.2 * MS, final_2=3.5 * MS)
    for _ in range(60):  # lookup's first three tokens always accepted; the draft head's never
        for depth in range(1, 6):
            speculation.verified(LOOKUP, depth <= 3, depth)
            speculation.verified(DRAFT, False, depth)
    available = [5, 5]
    by_lookup = speculation.batch_proposals(available, [LOOKUP, LOOKUP])
    assert by_lookup == speculation.batch_proposals(available) >= 1  # lookup's rates where no source is given
    assert speculation.batch_proposals(available, [DRAFT, DRAFT]) == 0 < by_lookup


def test_short_proposals_between_cut_ones_do_not_delay_the_exploration():
    speculation = Speculation(num_layers=12)
    costs(speculation, layer_2=1.5 * MS, final_2=5 * MS)
    for _ in range(50):
        for depth, accepted in ((1, True), (2, False)):
            speculation.verified(LOOKUP, accepted, depth)
    assert speculation.lookup_length(5) == 1
    # proposals of 1 token (proposed whole: nothing to cut) come between the 5-token ones that are cut to 1
    proposed = [speculation.lookup_tokens(count) for _ in range(2 * EXPLORE) for count in (1, 5, 1)]
    long_ones = proposed[1::3]
    assert long_ones.count(5) == 2 and long_ones[EXPLORE - 1] == 5 and long_ones.count(1) == 2 * EXPLORE - 2
    assert proposed[0::3] == [1] * 2 * EXPLORE and proposed[2::3] == [1] * 2 * EXPLORE


def test_a_depth_is_learned_only_from_the_tokens_judged_there():
    speculation = Speculation(num_layers=12)
    costs(speculation, layer_2=1.5 * MS, final_2=5 * MS)
    for _ in range(40):
        speculation.verified(LOOKUP, True, 1)
        speculation.verified(LOOKUP, False, None)  # discarded unjudged after a rejection: no depth's verdict
    assert speculation.lookup_depth[0].value > 0.9 and len(speculation.lookup_depth) == 1
    assert speculation.lookup_rate.value == pytest.approx(0.5, abs=0.05)  # every proposed token: the share reported


def test_when_adaptive_speculation_is_on():
    assert GenerationConfig(lookup_tokens=0).adapts("cpu")  # the exits alone (with lookup on, lookup alone: no)
    assert not GenerationConfig().adapts("cpu")
    assert not GenerationConfig().adapts("cuda")  # a call's host time is not its cost there
    assert not GenerationConfig(thresholds=0.5).adapts("cpu")  # explicit thresholds are used as given
    assert not GenerationConfig(temperature=0.7).adapts("cpu")  # a seed must reproduce its sequence
    assert GenerationConfig(thresholds=0.5, adaptive=True).adapts("cuda")
    assert not GenerationConfig(adaptive=False).adapts("cpu")
    with pytest.raises(UserInputError, match="adaptive must be True, False or None"):
        GenerationConfig(adaptive="yes")


def test_the_defaults_call_no_exit_heads_where_they_were_measured_not_to_pay():
    """adaptive None decides once, by measurement, where it does not adapt: with the export's thresholds in the
    batched overlap, no exit heads on a GPU (greedy or sampled), and on a CPU when sampling or when lookup is on.
    Elsewhere, or asked otherwise, the thresholds are the export's or the given."""
    export, never = {8: 0.9, 23: 0.8}, {8: math.inf, 23: math.inf}
    sampled, greedy = GenerationConfig(temperature=0.7), GenerationConfig()
    assert GenerationConfig().lookup_tokens > 0  # lookup is on by default
    assert sampled.resolve_thresholds(export, "cpu", "batched") == never
    assert sampled.resolve_thresholds(export, "cuda", "batched") == never
    assert greedy.resolve_thresholds(export, "cuda", "batched") == never
    assert greedy.resolve_thresholds(export, "cpu", "batched") == never  # with lookup: lookup alone
    no_lookup = GenerationConfig(lookup_tokens=0)
    assert no_lookup.resolve_thresholds(export, "cpu", "batched") == export  # the exits are the speculation
    assert no_lookup.resolve_thresholds(export, "cuda", "batched") == never
    assert GenerationConfig(temperature=0.7, lookup_tokens=0).resolve_thresholds(export, "cpu", "batched") == never
    # lookup alone, as measured, does not adapt; the exits alone (lookup off) do
    assert not greedy.adapts("cpu", "batched") and no_lookup.adapts("cpu", "batched")
    assert GenerationConfig(adaptive=True).adapts("cpu", "batched")
    for overlap in ("streams", "both"):  # not measured there
        assert sampled.resolve_thresholds(export, "cpu", overlap) == export
        assert greedy.resolve_thresholds(export, "cuda", overlap) == export
    for asked in ({"adaptive": False}, {"adaptive": True}):
        assert GenerationConfig(**asked).resolve_thresholds(export, "cuda", "batched") == export
        for device in ("cpu", "cuda"):
            config = GenerationConfig(temperature=0.7, **asked)
            assert config.resolve_thresholds(export, device, "batched") == export
    for device in ("cpu", "cuda"):
        given = GenerationConfig(temperature=0.7, thresholds=0.5).resolve_thresholds(export, device, "batched")
        assert given == {8: 0.5, 23: 0.5}


def test_paradecode_with_nothing_to_speculate_says_so_once(stories_export, caplog):
    """Sampling on a CPU with the defaults calls no exit heads; with lookup off too, ParaDecode is ar made slower."""
    with load(stories_export[0]) as model, caplog.at_level("WARNING", logger="paradecode.runtime.model"):
        model.request(prompt_ids=[1], temperature=0.7, lookup_tokens=5, overlap="batched")
        model.request(prompt_ids=[1], temperature=0.7, lookup_tokens=0, overlap="streams")  # not measured there
        model.request(prompt_ids=[1], temperature=0.7, lookup_tokens=0, thresholds=0.5, overlap="batched")
        assert not [r for r in caplog.records if "nothing to speculate" in r.message]
        for _ in range(2):
            model.request(prompt_ids=[1], temperature=0.7, lookup_tokens=0, overlap="batched")
    warnings = [r.message for r in caplog.records if "nothing to speculate" in r.message]
    assert len(warnings) == 1 and "when sampling on a CPU" in warnings[0] and "mode 'ar'" in warnings[0]


def test_a_warm_up_says_nothing_a_request_will_say(stories_export, caplog):
    config = GenerationConfig(temperature=0.7, lookup_tokens=0, overlap="batched")
    with load(stories_export[0]) as model, caplog.at_level("WARNING", logger="paradecode.runtime.model"):
        model.warm_up(config)
        assert not [r for r in caplog.records if "nothing to speculate" in r.message]
        model.generate(prompt_ids=[1], config=config, max_new_tokens=4)
        model.generate(prompt_ids=[1], config=config, max_new_tokens=4)
    assert len([r for r in caplog.records if "nothing to speculate" in r.message]) == 1


def test_adaptive_speculation_stops_exits_that_do_not_pay_and_keeps_the_output(stories_export):
    """stories260K without trained heads: at threshold 0 every token exits and nearly every exit is rolled back.
    Adaptive speculation must notice and pass most exits up, with the same tokens as plain decoding."""
    with load(stories_export[0]) as model:
        ar = model.generate(prompt_ids=[1], max_new_tokens=120, mode="ar", ignore_eos=True)
        forced = model.generate(prompt_ids=[1], max_new_tokens=120, thresholds=0.0, overlap="batched", ignore_eos=True)
        adaptive = model.generate(
            prompt_ids=[1], max_new_tokens=120, thresholds=0.0, overlap="batched", ignore_eos=True, adaptive=True
        )
    assert forced.token_ids == ar.token_ids and adaptive.token_ids == ar.token_ids
    assert forced.stats.exits_skipped == 0 and forced.stats.rollbacks > 40, forced.stats
    assert adaptive.stats.exits_skipped > 40, adaptive.stats
    assert adaptive.stats.rollbacks < forced.stats.rollbacks / 2, (adaptive.stats, forced.stats)


def test_the_decoder_reports_each_lookup_token_with_its_place_in_its_proposal(stories_export, monkeypatch):
    """A proposal's d-th token is judged only after its (d-1)-th was accepted; discarded ones carry no place. An
    oracle proposer (plain decoding's own continuation, its 4th token made wrong) makes every place judged."""
    from paradecode.runtime.lookup import SuffixIndex

    verdicts = []
    real = Speculation.verified

    def record(self, source, accepted, depth=None):
        verdicts.append((source, accepted, depth))
        return real(self, source, accepted, depth)

    with load(stories_export[0]) as model:
        ar = model.generate(prompt_ids=[1], max_new_tokens=120, mode="ar", ignore_eos=True)
        full = [1, *ar.token_ids]

        def oracle(self, tokens, end, count):
            proposal = list(full[end : end + count])
            if len(proposal) >= 4:
                proposal[3] = (proposal[3] + 1) % model.backend.spec.vocab_size
            return proposal

        monkeypatch.setattr(Speculation, "verified", record)
        monkeypatch.setattr(SuffixIndex, "propose", oracle)
        ours = model.generate(prompt_ids=[1], max_new_tokens=120, lookup_tokens=5, adaptive=True, ignore_eos=True)
    assert ours.token_ids == ar.token_ids
    judged = [(accepted, depth) for source, accepted, depth in verdicts if source == LOOKUP and depth is not None]
    assert {depth for _, depth in judged} == {1, 2, 3, 4}, judged  # the 5th follows a wrong 4th: never judged
    assert all(accepted == (depth < 4) for accepted, depth in judged), judged
    previous = None
    for accepted, depth in judged:
        assert depth == 1 or previous == (True, depth - 1), (previous, (accepted, depth))
        previous = (accepted, depth)
    discarded = [v for v in verdicts if v[0] == LOOKUP and v[2] is None]
    assert discarded and not any(accepted for _, accepted, _ in discarded)
