"""Prompt-lookup proposals: the n-gram index on its own, and in the scheduler (parity with ar)."""

from __future__ import annotations

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig
from paradecode.runtime.lookup import LookupConfig, NgramIndex
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
