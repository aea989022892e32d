"""Lookup proposals: the suffix index on its own (against a plain scan), and in the scheduler (parity with ar)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy
import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig
from paradecode.runtime.lookup import LookupConfig, SharedSuffixIndex, SuffixIndex
from tests.parity import assert_same_tokens, export_scorer

pytestmark = pytest.mark.timeout(300)


def index_of(tokens, upto=None, **settings) -> SuffixIndex:
    index = SuffixIndex(LookupConfig(**settings))
    index.extend(tokens, len(tokens) if upto is None else upto)
    return index


def scanned(tokens, verified, end, count, config: LookupConfig) -> list[int]:
    """SuffixIndex.propose's answer written as a plain scan over tokens[:end] (its docstring's three steps)."""
    lo, hi = config.min_ngram, config.max_ngram
    occurrences = {}  # index after an earlier occurrence -> its match length
    for s in range(lo, min(end, verified)):
        length = 0
        while length < hi and s - 1 - length >= 0 and tokens[s - 1 - length] == tokens[end - 1 - length]:
            length += 1
        if length >= lo:
            occurrences[s] = length
    # the index compares only the newest OCCURRENCES occurrences of the last min_ngram tokens
    occurrences = dict(sorted(occurrences.items())[-SuffixIndex.OCCURRENCES :])
    if count < 1 or not occurrences:
        return []
    longest = max(occurrences.values())
    alive = [s for s, length in occurrences.items() if length == longest]
    if math.isfinite(config.length_factor):
        count = min(count, max(1, int(config.length_factor * longest)))
    out = []
    for offset in range(count):
        continuing = [s for s in alive if s + offset < verified]
        if not continuing:
            break
        votes = Counter(tokens[s + offset] for s in continuing)
        # the newest occurrence among those whose token has the most votes gives the token
        newest_first = sorted(continuing, reverse=True)
        token = next(tokens[s + offset] for s in newest_first if votes[tokens[s + offset]] == max(votes.values()))
        out.append(token)
        alive = [s for s in continuing if tokens[s + offset] == token]
    return out


def test_the_docstrings_worked_example():
    tokens = [5, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]
    index = index_of(tokens)
    assert index.match(tokens, 12) == (3, [3])
    assert index.propose(tokens, 12, 5) == [9, 4, 6]  # as long as the match: 3 tokens
    assert index.propose(tokens, 12, 2) == [9, 4]
    tokens = [0, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]
    assert index_of(tokens).propose(tokens, 12, 5) == [8, 1]  # two matches of 2, 9 and 8 tie: the newest


def test_the_longest_match_wins_and_its_occurrences_vote():
    # "1 2 3" occurred three times after other tokens than the suffix's 14: twice followed by 4 5, once (the
    # newest) by 7; "2 3" alone also by 9
    tokens = [10, 1, 2, 3, 4, 5, 11, 1, 2, 3, 4, 5, 12, 8, 2, 3, 9, 13, 1, 2, 3, 7, 14, 1, 2, 3]
    index = index_of(tokens, length_factor=math.inf)
    assert index.match(tokens, len(tokens)) == (3, [4, 10, 21])
    assert index.propose(tokens, len(tokens), 2) == [4, 5]  # two of three agree on 4, both then on 5
    # then 11 and 12 tie: the newest occurrence's, which goes on while it has verified tokens
    assert index.propose(tokens, len(tokens), 8) == [4, 5, 12, 8, 2, 3, 9, 13]
    assert index_of(tokens, length_factor=1.0).propose(tokens, len(tokens), 8) == [4, 5, 12]  # 3: the match's


def test_no_match_no_proposal_and_proposals_stop_at_the_verified_tokens():
    tokens = [4, 5, 6, 4, 5]
    index = index_of(tokens, upto=4, max_ngram=2, min_ngram=2, length_factor=math.inf)  # tokens[4] unverified
    assert index.propose(tokens, 5, 5) == [6, 4]  # "4 5" at 0-1, then 6 and 4 (verified); not 5 (unverified)
    assert index.propose([7, 8], 2, 5) == []
    assert index.propose(tokens, 5, 0) == []
    assert index.propose([4], 1, 5) == []  # shorter than the shortest match


def test_the_suffix_itself_is_not_its_own_earlier_occurrence():
    tokens = [1, 2, 3]
    assert index_of(tokens, max_ngram=2, min_ngram=1).propose(tokens, 3, 3) == []


@pytest.mark.parametrize(
    "settings", [{}, {"min_ngram": 1, "max_ngram": 4, "length_factor": math.inf}, {"length_factor": 0.5}]
)
def test_the_index_answers_as_a_plain_scan_of_the_tokens(settings):
    """The proposer is a pure function of tokens[:end], the verified count and its settings: the index, grown in
    steps as decoding grows it, answers exactly what a scan of the tokens answers."""
    config = LookupConfig(**settings)
    rng = random.Random(0)
    for trial in range(46):
        vocab = rng.choice([2, 3, 5])
        # the last few: long enough that a 2-gram occurs more than OCCURRENCES times
        length = rng.randrange(5, 120) if trial < 40 else rng.randrange(300, 420)
        tokens = [rng.randrange(vocab if trial < 40 else 2) for _ in range(length)]
        index = SuffixIndex(config)
        verified = 0
        while verified < len(tokens):
            verified = min(len(tokens), verified + rng.randrange(1, 6))
            index.extend(tokens, verified)
            for end in {verified, min(len(tokens), verified + rng.randrange(0, 4))}:
                count = rng.randrange(0, 7)
                want = scanned(tokens, verified, end, count, config)
                assert index.propose(tokens, end, count) == want, (trial, tokens, verified, end, count)


def test_a_huge_length_factor_is_no_limit_not_an_overflow():
    tokens = [1, 2, 3, 4, 1, 2]
    for factor in (1e308, math.inf):
        assert index_of(tokens, length_factor=factor).propose(tokens, 6, 4) == [3, 4, 1, 2]
    tokens = list(range(1500)) * 2  # a proposal far longer than any default: no recursion limit in the way
    assert index_of(tokens, upto=1510, length_factor=math.inf).propose(tokens, 1510, 1200) == tokens[10:1210]


def test_only_the_newest_occurrences_are_compared():
    tokens = [1, 2, 3] * 100 + [9, 1, 2]  # "1 2" occurs 100 times before the suffix
    index = index_of(tokens, max_ngram=2)
    length, alive = index.match(tokens, len(tokens))
    assert length == 2 and len(alive) == SuffixIndex.OCCURRENCES and alive[-1] == 299


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "min_ngram"),
        ({"max_tokens": True}, "max_tokens"),
        ({"length_factor": 0}, "length_factor"),
        ({"length_factor": -1.0}, "length_factor"),
        ({"length_factor": math.nan}, "length_factor"),
        ({"length_factor": True}, "length_factor"),
        ({"length_factor": "1"}, "length_factor"),
    ],
)
def test_bad_lookup_settings(settings, message):
    with pytest.raises(UserInputError, match=message):
        LookupConfig(**settings)


def test_bad_generation_lookup_settings():
    with pytest.raises(UserInputError, match="lookup_tokens"):
        GenerationConfig(lookup_tokens=-1)
    with pytest.raises(UserInputError, match="min_ngram"):
        GenerationConfig(lookup_tokens=3, lookup_min_ngram=17)
    with pytest.raises(UserInputError, match="length_factor"):
        GenerationConfig(lookup_length_factor=0.0)
    config = GenerationConfig(lookup_max_ngram=4, lookup_length_factor=math.inf).lookup_config()
    assert (config.max_ngram, config.length_factor) == (4, math.inf)


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


# --- lookup over earlier requests' outputs (SharedSuffixIndex) --------------------------------------------------


def test_shared_suffix_index_worked_example():
    """The docstring's example: the longest match picks the documents, most of them must agree."""
    shared = SharedSuffixIndex(LookupConfig())
    shared.add([], [1, 2, 3, 4])
    shared.add([], [7, 2, 3, 5, 6])
    shared.add([], [8, 2, 3, 5, 0])
    assert shared.propose([9, 2, 3], 3, 5) == [5, 0]  # 2 of 3 agree on 5; then 6 and 0 tie, the newest wins
    assert shared.propose([7, 2, 3], 3, 5) == [5, 6]  # "7 2 3" matches the second document alone
    assert shared.propose([9, 9, 4], 3, 5) == [] and shared.propose([9, 2, 3], 3, 0) == []
    assert shared.propose([9, 2, 3], 3, 1) == [5]


def test_shared_suffix_index_follows_agreement_and_never_crosses_documents():
    shared = SharedSuffixIndex(LookupConfig(min_ngram=1, max_ngram=2, length_factor=float("inf")))
    shared.add([1, 2], [3, 4, 5, 6])  # the prompt's last tokens give the output's first ones a context
    assert shared.propose([9, 2, 3], 3, 5) == [4, 5, 6]  # then the document ends: nothing after it
    shared.add([0], [3, 4, 7])
    shared.add([0], [3, 4, 7])
    assert shared.propose([9, 3], 2, 5) == [4, 7]  # "3" alone matches all three: then 7 twice against 5 once
    assert shared.propose([2, 3], 2, 5) == [4, 5, 6]  # "2 3", the longer match, only the first document
    shared.add([0], [8, 1, 8, 2, 8, 3])  # "8": followed by 1, 2 and 3, no agreement
    assert shared.propose([5, 8], 2, 3) == []
    assert shared.propose([6], 1, 3) == []  # 6 ended a document: what came next in the corpus is another's


def test_shared_suffix_index_stays_within_its_bound():
    shared = SharedSuffixIndex(LookupConfig(), capacity=40)
    for start in range(0, 100, 10):
        shared.add([], list(range(start, start + 10)))  # 11 corpus tokens each, with the separator
        assert len(shared) <= 40
    assert len(shared) == 33 and shared.propose([0, 1], 2, 3) == [] and shared.propose([61, 62], 2, 3) == []
    assert shared.propose([91, 92], 2, 3) == [93, 94] and shared.propose([71, 72], 2, 3) == [73, 74]
    shared.add([], list(range(50)))  # longer than the bound: not kept
    assert len(shared) == 33
    shared.clear()
    assert len(shared) == 0 and shared.propose([91, 92], 2, 3) == []


def test_shared_suffix_index_forgets_as_a_fresh_index_of_what_it_keeps_would_be():
    """After many documents through a small bound, the index is exactly that of the documents kept."""
    generator = random.Random(0)
    shared = SharedSuffixIndex(LookupConfig(), capacity=97)
    added = []
    for _ in range(300):
        document = (
            [generator.randrange(6) for _ in range(generator.randrange(4))],
            [generator.randrange(6) for _ in range(generator.randrange(1, 12))],
        )
        shared.add(*document)
        added.append(document)
    fresh = SharedSuffixIndex(LookupConfig(), capacity=97)
    kept = len(shared.documents)
    for document in added[-kept:]:
        fresh.add(*document)
    assert fresh.corpus == shared.corpus and len(shared) <= 97
    relative = lambda index, base: {k: [p - base for p in v] for k, v in index.items()}
    assert relative(shared.starts, shared.base) == relative(fresh.starts, fresh.base)
    assert relative(shared.long_starts, shared.base) == relative(fresh.long_starts, fresh.base)
    for _ in range(200):
        query = [generator.randrange(6) for _ in range(10)]
        assert shared.propose(query, 10, 5) == fresh.propose(query, 10, 5)


def test_shared_suffix_index_never_proposes_a_prompt():
    """A document's prompt tail is context to match in, never a proposal: another request's prompt is not the
    model's output."""
    shared = SharedSuffixIndex(LookupConfig())
    shared.add(list(range(100, 108)), [1, 2])
    assert shared.propose([50, 100, 101, 102], 4, 5) == []  # what followed "101 102" was the prompt's own 103
    assert shared.propose([105, 106, 107], 3, 5) == [1, 2]  # the output, matched from the prompt's end
    shared.add(numpy.array([3, 4]), numpy.array([5, 6, 7]))  # arrays, as a caller may hold tokens
    proposed = shared.propose(numpy.array([9, 4, 5]), 3, 5)
    assert proposed == [6, 7] and all(type(t) is int for t in proposed)


def test_shared_suffix_index_finds_a_long_match_behind_many_short_ones():
    """A 16-token match in an old output is found even when its last tokens recur in more than OCCURRENCES
    newer ones; a backward match stops at a document's start."""
    shared = SharedSuffixIndex(LookupConfig(max_ngram=16))
    context = list(range(20, 36))
    shared.add([], [*context, 50, 51, 52])
    for _ in range(SharedSuffixIndex.OCCURRENCES + 10):
        shared.add([], [34, 35, 60])
    assert shared.propose([0, *context], 17, 5) == [50, 51, 52]  # a 16-long match: up to 16 tokens
    assert shared.propose([0, 34, 35], 3, 5) == [60]  # "34 35": the newest 64 agree on 60, then their ends
    shared = SharedSuffixIndex(LookupConfig())
    shared.add([], [1, 7])
    shared.add([], [2, 3, 9])
    shared.add([], [4, 2, 3, 8])
    assert shared.propose([7, 2, 3], 3, 5) == [8]  # "7 | 2 3" does not match across the separator: a tie, newest


def test_a_repeated_request_is_proposed_what_the_first_produced(stories_export):
    """With lookup_shared, a request's output feeds later requests' lookup; outputs stay ar's either way."""
    from paradecode.runtime import load

    with load(stories_export[0]) as model:
        settings = dict(prompt="Once upon a time", max_new_tokens=40, thresholds=float("inf"), ignore_eos=True)
        want = model.generate(mode="ar", **settings).token_ids
        alone = model.generate(lookup_shared=False, **settings)
        assert len(model.shared_index) == 0  # requests without lookup_shared leave nothing behind
        first = model.generate(lookup_shared=True, **settings)
        assert len(model.shared_index) > 0
        again = model.generate(lookup_shared=True, **settings)
        assert alone.token_ids == first.token_ids == again.token_ids == want
        assert again.stats.lookup_accepted > first.stats.lookup_accepted
        assert again.stats.lookup_accepted >= len(want) // 2  # most of the repeat was proposed and accepted
    with pytest.raises(UserInputError, match="lookup_shared"):
        GenerationConfig(lookup_shared="yes")


def test_generate_cli_takes_the_lookup_match_settings(stories_export, capsys):
    from paradecode.runtime import cli

    argv = [str(stories_export[0]), "--prompt-ids", "1,2,3,1,2,3,1,2", "--max-new-tokens", "6", "--json"]
    assert cli.main([*argv, "--lookup-ngram", "4", "--lookup-length-factor", "inf"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 6
    with pytest.raises(SystemExit):
        cli.main([*argv, "--lookup-length-factor", "0"])
    assert "--lookup-length-factor" in capsys.readouterr().err


def test_every_proposal_sees_every_verified_token(stories_export, monkeypatch):
    """The index is grown to the verified tokens before each proposal, a rollback's first one included (the
    proposal after a rejected token used to miss the tokens verified with it)."""
    from paradecode.runtime import load
    from paradecode.runtime.planner import Planner

    asked, verified = [], []
    propose, decoder_propose = SuffixIndex.propose, Planner.propose

    def record(self, tokens, end, count):  # the index's extent when it answers, and the decoder's verified tokens
        asked.append((self.indexed, verified[-1]))
        return propose(self, tokens, end, count)

    def note(self, position):
        verified.append(self.verified)
        return decoder_propose(self, position)

    monkeypatch.setattr(SuffixIndex, "propose", record)
    monkeypatch.setattr(Planner, "propose", note)
    with load(stories_export[0]) as model:
        prompt = [1, *[(7 * i) % 50 + 2 for i in range(12)] * 3]
        ar = model.generate(prompt_ids=prompt, max_new_tokens=60, mode="ar", ignore_eos=True)
        ours = model.generate(prompt_ids=prompt, max_new_tokens=60, thresholds=0.0, lookup_tokens=4, ignore_eos=True)
    assert ours.token_ids == ar.token_ids
    assert ours.stats.rollbacks > 0 and asked
    assert all(indexed == known for indexed, known in asked), [a for a in asked if a[0] != a[1]][:5]
