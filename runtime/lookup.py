"""Prompt-lookup proposals: copy what followed an earlier occurrence of the newest tokens.

When the last n tokens occurred earlier in the prompt or the output, the tokens that followed that
occurrence are a good guess of what comes next (code repeats names, summaries and answers quote their
source). This is Hugging Face's `prompt_lookup_num_tokens` and vLLM's and TensorRT-LLM's n-gram
drafting. In ParaDecode's terms a looked-up token is a proposal pending at depth 0: the scheduler
computes it in the frontier's batched calls and the final layer verifies it like an early exit, so
the output stays exactly that of plain decoding (DESIGN.md §3).

`NgramIndex` keeps, for each n-gram size, where the newest occurrence of every n-gram of the
*verified* tokens ends, so a lookup costs a few dictionary reads, not a scan of the sequence.

`SharedContinuations` is the other source, shared by a loaded model's requests: what followed each n-gram in
earlier requests' outputs, counted (SuffixDecoding's global tree, in n-gram form). A request looks in its own
prompt and output first, and there second.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from paradecode.graphs.errors import UserInputError


@dataclass(frozen=True)
class LookupConfig:
    """`ngram`: the longest and shortest suffix to match (longest first); `max_tokens`: the most tokens
    proposed at once (the scheduler's limit on unverified tokens applies on top)."""

    max_ngram: int = 3
    min_ngram: int = 2
    max_tokens: int = 5

    def __post_init__(self) -> None:
        for name in ("max_ngram", "min_ngram", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserInputError(f"lookup {name} must be a positive integer, got {value!r}.")
        if self.min_ngram > self.max_ngram:
            raise UserInputError(
                f"lookup min_ngram ({self.min_ngram}) is above max_ngram ({self.max_ngram}): the suffix lengths "
                "tried run from max_ngram down to min_ngram."
            )


class NgramIndex:
    """Where the newest occurrence of each n-gram of a growing token sequence ends.

    `extend(tokens, upto)` indexes tokens[:upto] (it must only ever grow: verified tokens never change);
    `propose(tokens, end, count)` looks up the suffix of tokens[:end] (which may end in unverified tokens)
    and returns up to `count` tokens that followed its newest earlier occurrence.
    """

    def __init__(self, config: LookupConfig):
        self.config = config
        self.sizes = range(config.max_ngram, config.min_ngram - 1, -1)
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}  # n-gram -> next index
        self.indexed = 0  # tokens[:indexed] are indexed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index every n-gram whose continuation starts at an index in (indexed, upto)."""
        for start in range(max(self.indexed, 1), upto):  # an n-gram ending at start - 1, followed by tokens[start]
            for n in self.sizes:
                if start >= n:
                    self.after[n][tuple(tokens[start - n : start])] = start
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` tokens that followed the newest earlier occurrence of the longest matching suffix."""
        if count < 1:
            return []
        for n in self.sizes:
            if end < n:
                continue
            start = self.after[n].get(tuple(tokens[end - n : end]))
            if start is not None and start < end:
                return list(tokens[start : min(start + count, self.indexed)])
        return []


class SharedContinuations:
    """What followed each n-gram in the outputs of a loaded model's earlier requests, counted: proposals for a
    request from what other requests' outputs did (SuffixDecoding's global tree, in n-gram form).

    `add(prompt, output)` counts, for every n-gram of the prompt's last tokens and the output (n in the lookup's
    sizes), the token that followed it. `propose(tokens, end, count)` follows, from the longest suffix of
    tokens[:end] seen before, the continuation earlier outputs took most often, one token at a time, and stops
    where they disagreed (the top token followed its n-gram in less than `AGREEMENT` of the cases) or nothing
    was seen: so a proposal is as long as earlier outputs support it. Proposals are only proposals: the final
    layer verifies each, so nothing of one request reaches another except tokens the model itself produces.

    Memory is bounded: past `max_contexts` n-grams the oldest are forgotten. Thread-safe (one lock): a server's
    requests add and propose from several threads.
    """

    AGREEMENT = 0.5

    def __init__(self, config: LookupConfig | None = None, max_contexts: int = 200_000):
        self.config = config or LookupConfig()
        self.sizes = range(self.config.max_ngram, self.config.min_ngram - 1, -1)
        self.max_contexts = max_contexts
        # n-gram -> {following token: count}, oldest n-gram first (an OrderedDict forgets its first in O(1))
        self.next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.next)

    def clear(self) -> None:
        with self.lock:
            self.next.clear()

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Count what followed every n-gram of `output` (and of the prompt's end, before the output's first token)."""
        longest = self.config.max_ngram
        tokens = [*prompt[-longest:], *output]
        first = len(tokens) - len(output)  # the index of the output's first token
        with self.lock:
            for i in range(max(first, 1), len(tokens)):
                for n in self.sizes:
                    if i >= n:
                        following = self.next.setdefault(tuple(tokens[i - n : i]), {})
                        following[tokens[i]] = following.get(tokens[i], 0) + 1
            while len(self.next) > self.max_contexts:  # forget the oldest n-grams
                self.next.popitem(last=False)

    def propose(self, tokens: Sequence[int], end: int, count: int) -> list[int]:
        """Up to `count` tokens earlier outputs agree on after tokens[:end]."""
        context = list(tokens[max(0, end - self.config.max_ngram) : end])
        proposals: list[int] = []
        with self.lock:
            while len(proposals) < count:
                token = self._most_agreed(context)
                if token is None:
                    break
                proposals.append(token)
                context = [*context[1:], token] if len(context) >= self.config.max_ngram else [*context, token]
        return proposals

    def _most_agreed(self, context: list[int]) -> int | None:
        """The token that most often followed the longest known suffix of `context`, if earlier outputs agreed."""
        for n in self.sizes:
            if len(context) < n:
                continue
            following = self.next.get(tuple(context[-n:]))
            if following:
                token, seen = max(following.items(), key=lambda item: item[1])
                return token if seen >= self.AGREEMENT * sum(following.values()) else None
        return None
