"""Lookup proposals: copy what followed the earlier occurrences of the newest tokens.

When the newest tokens occurred earlier in the prompt or the output, the tokens that followed that
occurrence are a good guess of what comes next (code repeats names, summaries and answers quote their
source). This is Hugging Face's `prompt_lookup_num_tokens`, vLLM's and TensorRT-LLM's n-gram drafting and,
with the longest match and its continuations counted, SuffixDecoding's per-request suffix tree. In
ParaDecode's terms a looked-up token is a proposal pending at depth 0: the scheduler computes it in the
frontier's batched calls and the final layer verifies it like an early exit, so the output stays exactly
that of plain decoding (docs/design.md §3).

A proposer answers one question, `propose(tokens, end, count) -> list[int]`: up to `count` tokens to follow
tokens[:end]. Its answer is a pure function of its inputs (and, for `SharedSuffixIndex`, of what earlier
requests produced); the index behind it only saves a scan. The scheduler asks its proposers in order (the
request's own `SuffixIndex`, then a model's `SharedSuffixIndex`) and takes the first non-empty answer.

- `SuffixIndex`: the request's own prompt and verified output. The longest suffix of tokens[:end] that
  occurred earlier (up to `max_ngram` tokens long), the continuation most of those occurrences agree on, and a
  proposal no longer than `length_factor` times the match: a long match predicts further than a short one.
- `SharedSuffixIndex`: the same longest match over earlier requests' outputs, with the continuation most of
  them agree on (SuffixDecoding's global tree). Asked only where the request's own tokens have no match.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from paradecode.graphs.errors import UserInputError


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` tokens to follow tokens[:end] (tokens past the verified ones may be unverified)."""
        ...


@dataclass(frozen=True)
class LookupConfig:
    """`max_ngram` / `min_ngram`: the longest and shortest suffix matched; `max_tokens`: the most tokens proposed
    at once (the scheduler's limit on unverified tokens applies on top); `length_factor`: a proposal is at most
    this many times as long as its match (SuffixDecoding's `max_spec_factor`; inf: no such limit)."""

    max_ngram: int = 16
    min_ngram: int = 2
    max_tokens: int = 5
    length_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_ngram", "min_ngram", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserInputError(f"lookup {name} must be a positive integer, got {value!r}.")
        if self.min_ngram > self.max_ngram:
            raise UserInputError(
                f"lookup min_ngram ({self.min_ngram}) is above max_ngram ({self.max_ngram}): the suffix lengths "
                "matched run from min_ngram up to max_ngram."
            )
        factor = self.length_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or math.isnan(factor) or factor <= 0:
            raise UserInputError(
                f"lookup length_factor must be a positive number (a proposal's length over its match's; inf: no "
                f"limit), got {factor!r}."
            )


def longest_matches(
    source: Sequence[int], starts: Sequence[int], tokens: Sequence[int], end: int, config: LookupConfig
) -> tuple[int, list[int]]:
    """Of the occurrences `starts` in `source` (the indices of the tokens after them, whose last min_ngram tokens
    equal tokens[:end]'s), the longest match of tokens[:end]'s suffix, up to max_ngram: (its length, the starts
    that match that long, in their order)."""
    matched = {s: match_length(source, s, tokens, end, config) for s in starts}
    longest = max(matched.values())
    return longest, [s for s in starts if matched[s] == longest]


def match_length(source: Sequence[int], start: int, tokens: Sequence[int], end: int, config: LookupConfig) -> int:
    """How many tokens before source[start] equal those before tokens[end] (min_ngram already do), up to max_ngram.
    A separator in `source` (SharedSuffixIndex.SEPARATOR) never equals a token."""
    length = config.min_ngram
    while length < config.max_ngram and start - 1 - length >= 0 and end - 1 - length >= 0:
        if source[start - 1 - length] != tokens[end - 1 - length]:
            break
        length += 1
    return length


def proposal_length(config: LookupConfig, longest: int, count: int) -> int:
    """A proposal's length: at most `count`, and at most length_factor times the match's length (at least 1)."""
    return min(count, max(1, int(min(config.length_factor * longest, count))))


class SuffixIndex:
    """Proposals from the longest earlier match of a request's newest tokens, in its prompt and verified output.

    `extend(tokens, upto)` indexes tokens[:upto] (it must only ever grow: verified tokens never change).
    `propose(tokens, end, count)` answers from tokens[:end] (which may end in unverified tokens):

    1. the match: the earlier occurrences of the longest suffix of tokens[:end], from `min_ngram` up to
       `max_ngram` tokens long (among the newest OCCURRENCES occurrences of its last `min_ngram` tokens);
    2. the length: at most `count`, and at most `length_factor` times the match's length (at least 1);
    3. the continuation, a token at a time: the token most of the remaining occurrences continue with (a tie
       goes to the newest occurrence's), then only the occurrences that continued so; it ends where none of
       them has a verified token left.

    Worked example (min_ngram 2, max_ngram 16, length_factor 1.0), all 12 tokens verified:

        tokens = [5, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]
        suffix [6, 7]: occurs at 1-2 (then 9) and at 5-6 (then 8); [5, 6, 7] only at 0-2: the match is 3 long
        propose(tokens, 12, 5) -> [9, 4, 6]     3 tokens (1.0 x the match), what followed [5, 6, 7]
        propose(tokens, 12, 2) -> [9, 4]
        tokens = [0, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]: both matches 2 long, so 2 tokens; 9 and 8 tie, the
        newest occurrence's wins: propose(tokens, 12, 5) -> [8, 1]

    The answer depends on tokens[:end], the indexed tokens and the settings only; the scheduler indexes every
    verified token before it asks, so it is a function of tokens[:end], the verified count and the settings.
    """

    OCCURRENCES = 64  # newest occurrences of the last min_ngram tokens compared: bounds a proposal's work

    def __init__(self, config: LookupConfig):
        self.config = config
        self.starts: dict[tuple[int, ...], list[int]] = {}  # min_ngram-gram -> indices of the tokens after it
        self.indexed = 0  # tokens[:indexed] are indexed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index every occurrence whose continuation starts at an index in (indexed, upto)."""
        n = self.config.min_ngram
        for start in range(max(self.indexed, n), upto):  # tokens[start - n : start], followed by tokens[start]
            self.starts.setdefault(tuple(tokens[start - n : start]), []).append(start)
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` tokens that followed the longest earlier match of tokens[:end]'s suffix."""
        chain = self.branches(tokens, end, count, width=1)
        return chain[0] if chain else []

    def branches(self, tokens: Sequence[int], end: int, count: int, width: int) -> list[list[int]]:
        """A tree of proposals, as its branches (root to leaf), most agreed first: step 3 with the `width` most
        agreed tokens at each depth (ties to the newest occurrence's), each followed on with the occurrences that
        continued so. Width 1 is `propose`'s chain; wider trees are what verifying several candidates would take
        (tools/lab/lookup_replay.py replays them; the runtime verifies chains).

            tokens = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]   "9 1 2" then 3 twice, then 4 once
            branches(tokens, 15, 2, 1) -> [[3, 9]]
            branches(tokens, 15, 2, 2) -> [[3, 9], [4, 9]]
        """
        longest, alive = self.match(tokens, end)
        if count < 1 or not alive:
            return []
        count = proposal_length(self.config, longest, count)
        found: list[list[int]] = []
        stack = [([], alive)]  # (a branch's tokens so far, the occurrences that continued so), depth first
        while stack:
            prefix, occurrences = stack.pop()
            following = [(tokens[s + len(prefix)], s) for s in occurrences if s + len(prefix) < self.indexed]
            if len(prefix) == count or not following:
                if prefix:
                    found.append(prefix)
                continue
            votes = Counter(token for token, _ in following)
            newest = dict(following)  # occurrences run oldest first: each token's last one is its newest
            ranked = sorted(votes, key=lambda token: (votes[token], newest[token]), reverse=True)[:width]
            for token in reversed(ranked):  # the most agreed is taken next
                stack.append(([*prefix, token], [s for t, s in following if t == token]))
        return found

    def match(self, tokens: Sequence[int], end: int) -> tuple[int, list[int]]:
        """The longest earlier match of tokens[:end]'s suffix: (its length, the indices of the tokens that
        followed its occurrences, oldest first); (0, []) where the last min_ngram tokens never occurred before."""
        n = self.config.min_ngram
        if end < n:
            return 0, []
        starts = self.starts.get(tuple(tokens[end - n : end]), [])
        before = bisect.bisect_left(starts, end)  # starts are ascending: the occurrences before `end`
        starts = starts[max(0, before - self.OCCURRENCES) : before]
        if not starts:
            return 0, []
        return longest_matches(tokens, starts, tokens, end, self.config)


class SharedSuffixIndex:
    """Proposals from the longest match of a request's newest tokens in earlier requests' outputs: SuffixDecoding's
    global suffix tree, as a suffix index over a bounded corpus of the outputs a loaded model produced.

    `add(prompt, output)` appends the output to the corpus as one document, after its prompt's last `max_ngram`
    tokens: those give the output's first tokens a context to be matched in, and are never proposed (another
    request's prompt is not the model's output). No match or continuation crosses a document's end.
    `propose(tokens, end, count)` answers from tokens[:end]:

    1. the match: the occurrences (continuing into an output) of the longest suffix of tokens[:end], from
       `min_ngram` up to `max_ngram` tokens long, among the newest OCCURRENCES occurrences of its last LONG_KEY
       tokens, or where those never occurred, of its last `min_ngram` tokens (so a long match in an older output
       is found however often its last few tokens recur in newer ones);
    2. the length: at most `count`, and at most `length_factor` times the match's length (at least 1);
    3. the continuation, a token at a time: the token most of the remaining occurrences continue with, if at
       least AGREEMENT of them do (a tie goes to the newest occurrence's), then only the occurrences that
       continued so; it ends where they disagree or their documents end.

    Worked example (min_ngram 2, max_ngram 16, length_factor 1.0):

        add([], [1, 2, 3, 4]); add([], [7, 2, 3, 5, 6]); add([], [8, 2, 3, 5, 0])
        propose([9, 2, 3], 3, 5) -> [5, 0]   "2 3" (2 long) in all three: 4, 5, 5 follow, 2 of 3 agree on 5;
                                             then 6 and 0 tie and the newest occurrence's wins; 2 tokens at most
        propose([7, 2, 3], 3, 5) -> [5, 6]   "7 2 3" (3 long) in the second only: what followed it there
        propose([9, 9, 4], 3, 5) -> []      "9 4" never occurred

    The settings are the index's own (a model's: the defaults), not a request's: `min_ngram` and LONG_KEY key it.
    Memory is bounded: a document that would take the corpus past `capacity` tokens first makes it forget its
    oldest documents, each with its index entries (the oldest of every list they are in), so an `add` costs
    what it adds and what it forgets. Proposals are only proposals: the final layer verifies each, so nothing
    of one request reaches another except tokens the model itself produced.

    Threading model: `corpus`, `base`, `documents`, `starts` and `long_starts` are read and written only while
    holding `lock` (a server's requests add and propose from several threads); `config` and `capacity` never
    change.
    """

    AGREEMENT = 0.5
    OCCURRENCES = SuffixIndex.OCCURRENCES
    LONG_KEY = 8  # a second key: the last 8 tokens, asked first
    SEPARATOR = -1  # between documents: never a token, so no match or continuation crosses it

    def __init__(self, config: LookupConfig | None = None, capacity: int = 200_000):
        self.config = config or LookupConfig()
        self.capacity = capacity
        self.corpus: list[int] = []  # the documents kept, each followed by SEPARATOR
        self.base = 0  # the position of corpus[0]: positions count every token ever added, forgotten ones too
        self.documents: deque[tuple[int, int]] = deque()  # (length with the separator, output's first index)
        # the positions of what followed each min_ngram-gram (each LONG_KEY-gram), oldest first
        self.starts: dict[tuple[int, ...], deque[int]] = {}
        self.long_starts: dict[tuple[int, ...], deque[int]] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        """Corpus tokens held (documents with their separators)."""
        return len(self.corpus)

    def clear(self) -> None:
        with self.lock:
            self.base += len(self.corpus)
            self.corpus.clear()
            self.documents.clear()
            self.starts.clear()
            self.long_starts.clear()

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Add `output`, after its prompt's last max_ngram tokens, as one document (not kept when longer than the
        whole bound)."""
        tail = [int(t) for t in prompt[len(prompt) - min(len(prompt), self.config.max_ngram) :]]
        document = [*tail, *map(int, output)]
        if len(output) == 0 or len(document) + 1 > self.capacity:
            return
        with self.lock:
            while len(self.corpus) + len(document) + 1 > self.capacity:
                self._forget_oldest()
            for key, index, i in self._occurrences(document, len(tail)):
                index.setdefault(key, deque()).append(self.base + len(self.corpus) + i)
            self.corpus += [*document, self.SEPARATOR]
            self.documents.append((len(document) + 1, len(tail)))

    def propose(self, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` tokens earlier outputs agree on after the longest match of tokens[:end]'s suffix."""
        n = self.config.min_ngram
        if count < 1 or end < n:
            return []
        with self.lock:
            found = self.long_starts.get(tuple(tokens[end - self.LONG_KEY : end])) if end >= self.LONG_KEY else None
            found = found or self.starts.get(tuple(tokens[end - n : end]), ())
            starts = [p - self.base for p in itertools.islice(reversed(found), self.OCCURRENCES)][::-1]
            if not starts:
                return []
            longest, alive = longest_matches(self.corpus, starts, tokens, end, self.config)
            count = proposal_length(self.config, longest, count)
            proposals: list[int] = []
            while len(proposals) < count:
                following = [(self.corpus[s + len(proposals)], s) for s in alive]
                votes = Counter(token for token, _ in following if token != self.SEPARATOR)
                if not votes:
                    break
                newest = dict(following)  # occurrences run oldest first: each token's last one is its newest
                token = max(votes, key=lambda t: (votes[t], newest[t]))
                if votes[token] < self.AGREEMENT * len(following):
                    break
                proposals.append(token)
                alive = [s for t, s in following if t == token]
            return proposals

    def _occurrences(self, document: Sequence[int], first: int):
        """(key, the index it goes in, i) for every occurrence in `document` whose continuation document[i] is
        output (i >= first), oldest first: its min_ngram-gram, and its LONG_KEY-gram where it has one."""
        n, long = self.config.min_ngram, self.LONG_KEY
        for i in range(max(n, first), len(document)):
            yield tuple(document[i - n : i]), self.starts, i
            if i >= long:
                yield tuple(document[i - long : i]), self.long_starts, i

    def _forget_oldest(self) -> None:
        """Drop the oldest document and its index entries: the oldest of every list it is in."""
        length, first = self.documents.popleft()
        for key, index, _ in self._occurrences(self.corpus[: length - 1], first):
            positions = index[key]
            positions.popleft()
            if not positions:
                del index[key]
        del self.corpus[:length]
        self.base += length
