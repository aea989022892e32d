"""Prompt-lookup proposals: the n-gram index on its own, and in the scheduler (parity with ar)."""

from __future__ import annotations

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig
from paradecode.runtime.lookup import LookupConfig, NgramIndex, SharedContinuations
from tests.parity import assert_same_tokens, export_scorer

pytestmark = pytest.mark.timeout(300)


def index_of(tokens, **settings) -> NgramIndex:
    index = NgramIndex(LookupConfig(**settings))
    index.extend(tokens, len(tokens))
    return index


def test_the_newest_earlier_occurrence_of_the_longest_suffix_is_copied():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    index = index_of(tokens, max_ngram=3, min_ngram=1, max_tokens=4)
    # "2 3" occurred at 1-2 (then 9) and at 5-6 (then 7 8 5): the newest wins
    assert index.propose(tokens, len(tokens), 4) == [7, 8, 5, 2]
    assert index.propose(tokens, len(tokens), 2) == [7, 8]
    # a longer match beats a newer shorter one: "1 2 3" -> what followed its newest occurrence
    assert index.propose([*tokens, 1, 2, 3], len(tokens) + 3, 3) == [7, 8, 5]


def test_no_match_no_proposal_and_proposals_stop_at_the_verified_tokens():
    tokens = [4, 5, 6, 4, 5]
    index = NgramIndex(LookupConfig(max_ngram=2, min_ngram=2, max_tokens=5))
    index.extend(tokens, 4)  # tokens[4] is not verified yet
    assert index.propose(tokens, 5, 5) == [6, 4]  # "4 5" at 0-1, then 6 and 4 (verified); not 5 (unverified)
    assert index.propose([7, 8], 2, 5) == []
    assert index.propose(tokens, 5, 0) == []


def test_the_suffix_itself_is_not_its_own_earlier_occurrence():
    tokens = [1, 2, 3]
    index = index_of(tokens, max_ngram=2, min_ngram=1)
    assert index.propose(tokens, 3, 3) == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "min_ngram"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_lookup_settings(settings, message):
    with pytest.raises(UserInputError, match=message):
        LookupConfig(**settings)


def test_bad_generation_lookup_settings():
    with pytest.raises(UserInputError, match="lookup_tokens"):
        GenerationConfig(lookup_tokens=-1)
    with pytest.raises(UserInputError, match="min_ngram"):
        GenerationConfig(lookup_tokens=3, lookup_min_ngram=4)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("overlap", ["batched", "streams", "both"])
@pytest.mark.parametrize("thresholds", [float("inf"), 0.0, 0.5])
def test_lookup_output_equals_ar(loaded, family, backend, overlap, thresholds):
    """A repetitive prompt makes lookup propose often; with exits too, proposals and early tokens mix."""
    model = loaded[family, backend]
    vocab = model.manifest.spec.vocab_size
    prompt = [(3 * i) % vocab for i in range(8)] * 3 + [5, 7]
    reference = model.generate(prompt_ids=prompt, max_new_tokens=30, mode="ar", ignore_eos=True)
    result = model.generate(
        prompt_ids=prompt,
        max_new_tokens=30,
        overlap=overlap,
        thresholds=thresholds,
        lookup_tokens=4,
        lookup_min_ngram=1,
        ignore_eos=True,
    )
    score = export_scorer(model)
    assert_same_tokens(
        result.token_ids, reference.token_ids, f"{family}/{backend}/{overlap}", prompt=prompt, score=score
    )
    stats = result.stats
    assert stats.lookup_proposed > 0 and 0 <= stats.lookup_accepted <= stats.lookup_proposed


# --- lookup over earlier requests' outputs (SharedContinuations) -------------------------------------------------


def test_shared_continuations_follow_what_earlier_outputs_agreed_on():
    shared = SharedContinuations(LookupConfig(max_ngram=2, min_ngram=1))
    shared.add([1, 2], [3, 4, 5, 6])
    assert shared.propose([9, 2, 3], 3, 5) == [4, 5, 6]  # "2 3" -> 4, "3 4" -> 5, "4 5" -> 6, then nothing seen
    assert shared.propose([9, 2, 3], 3, 2) == [4, 5]
    assert shared.propose([7, 8], 2, 5) == [] and shared.propose([9, 2, 3], 3, 0) == []
    shared.add([1, 2], [3, 4, 7])  # "3 4" was followed by 5 once and 7 once: half agree, the first seen wins
    assert shared.propose([2, 3], 2, 5) == [4, 5, 6]
    shared.add([1, 2], [3, 4, 7])  # now 7 twice against 5 once
    assert shared.propose([2, 3], 2, 5) == [4, 7]
    shared.add([0], [8, 1, 8, 2, 8, 3])  # "8" alone: followed by 1, 2, 3: no agreement, no proposal
    assert shared.propose([5, 8], 2, 3) == []


def test_shared_continuations_stay_within_their_bound():
    shared = SharedContinuations(LookupConfig(max_ngram=2, min_ngram=2), max_contexts=10)
    for start in range(0, 100, 10):
        shared.add([], list(range(start, start + 10)))
    assert len(shared) == 10
    assert shared.propose([0, 1], 2, 3) == []  # the oldest n-grams were forgotten
    assert shared.propose([91, 92], 2, 3) == [93, 94, 95]  # the newest are kept
    shared.clear()
    assert len(shared) == 0


def test_a_repeated_request_is_proposed_what_the_first_produced(stories_export):
    """With lookup_shared, a request's output feeds later requests' lookup; outputs stay ar's either way."""
    from paradecode.runtime import load

    with load(stories_export[0]) as model:
        settings = dict(prompt="Once upon a time", max_new_tokens=40, thresholds=float("inf"), ignore_eos=True)
        want = model.generate(mode="ar", **settings).token_ids
        alone = model.generate(lookup_shared=False, **settings)
        assert len(model.continuations) == 0  # requests without lookup_shared leave nothing behind
        first = model.generate(lookup_shared=True, **settings)
        assert len(model.continuations) > 0
        again = model.generate(lookup_shared=True, **settings)
        assert alone.token_ids == first.token_ids == again.token_ids == want
        assert again.stats.lookup_accepted > first.stats.lookup_accepted
        assert again.stats.lookup_accepted >= len(want) // 2  # most of the repeat was proposed and accepted
    with pytest.raises(UserInputError, match="lookup_shared"):
        GenerationConfig(lookup_shared="yes")
