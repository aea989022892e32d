"""Prompt-lookup proposals: copy what followed an earlier occurrence of the newest tokens.

When the last n tokens occurred earlier in the prompt or the output, the tokens that followed that
occurrence are a good guess of what comes next (code repeats names, summaries and answers quote their
source). This is Hugging Face's `prompt_lookup_num_tokens` and vLLM's and TensorRT-LLM's n-gram
drafting. In ParaDecode's terms a looked-up token is a proposal pending at depth 0: the scheduler
computes it in the frontier's batched calls and the final layer verifies it like an early exit, so
the output stays exactly that of plain decoding (DESIGN.md §3).

`NgramIndex` keeps, for each n-gram size, where the newest occurrence of every n-gram of the
*verified* tokens ends, so a lookup costs a few dictionary reads, not a scan of the sequence.
"""

from __future__ import annotations

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
