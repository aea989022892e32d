"""What a generate call returns and measures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LOOKUP = 0  # the source of a prompt-lookup proposal (exit layers are 1..L-1)
DRAFT = -1  # the source of a draft head's proposal (runtime/proposers.py `DraftProposer`)


@dataclass
class Mismatch:
    """A proposed token the final layer rejected: where, who proposed it, and how close the final call was."""

    position: int  # the position of the rejected token in the sequence
    source: int  # the exit layer that proposed it, LOOKUP (0) for a prompt-lookup proposal, DRAFT (-1) a draft head's
    early_token: int
    final_token: int
    final_margin: float  # top-1 minus top-2 logit of the final head at that position


@dataclass
class GenerationStats:
    mode: str
    overlap: str | None = None
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    exits_per_layer: dict[int, int] = field(default_factory=dict)  # early tokens proposed at each exit layer
    accepted_per_layer: dict[int, int] = field(default_factory=dict)  # ... and verified by the final layer
    lookup_proposed: int = 0  # tokens proposed by prompt lookup
    lookup_accepted: int = 0  # ... and verified by the final layer
    draft_proposed: int = 0  # tokens proposed by the draft head
    draft_accepted: int = 0  # ... and verified by the final layer
    rollbacks: int = 0
    # adaptive speculation (runtime/speculation.py): exit-head calls and lookup proposals passed up as not paying
    exits_skipped: int = 0
    lookups_skipped: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    lane_busy_seconds: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    stop_reason: str = ""  # "max_new_tokens", "eos", "stop_string", "max_seq_len", "closed", "cancelled"
    seed: int | None = None  # the sampling seed used (None: greedy); pass it back to reproduce the run

    def accept(self, source: int) -> None:
        """Count a proposed token the final layer verified."""
        if source == LOOKUP:
            self.lookup_accepted += 1
        elif source == DRAFT:
            self.draft_accepted += 1
        else:
            self.accepted_per_layer[source] = self.accepted_per_layer.get(source, 0) + 1

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.prefill_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding (after the prefill produced the first token)."""
        decoded = self.new_tokens - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens_per_second"] = self.tokens_per_second
        data["decode_seconds"] = self.decode_seconds
        data["exits_per_layer"] = {str(k): v for k, v in sorted(self.exits_per_layer.items())}
        data["accepted_per_layer"] = {str(k): v for k, v in sorted(self.accepted_per_layer.items())}
        return data


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    text: str | None
    stats: GenerationStats
    margins: list[float]  # final-head top-1/top-2 logit margin of each new token
    timeline: Any = None  # the calls' Timeline, under Tracing(spans=True); else None
    shown_text: str | None = None  # `text` as OpenAI's API shows it: cut before the first stop string
    stop_string: str | None = None  # the stop string `shown_text` was cut at (None: none was found)

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict()}
