"""When a request's output stops. The token-level rules (`Stops`: an end-of-sequence token, `max_new_tokens`, a
full KV cache) belong to the decoders: plain decoding and ParaDecode each take a request's `Stops`, decide after
every verified token and end there (ParaDecode also speculates no further). The text-level rule (a stop string)
belongs to `Completion`, the output's tokens and text as they grow. Both are shared by a model decoding one
request (`ParaDecodeModel`) and by a batch of requests (`runtime/engine.py`), so every path stops alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.tokenizer import TextStream, TextTokenizer

# Why a completion stopped (GenerationStats.stop_reason); `closed` and `cancelled` are set by its caller.
EOS, MAX_NEW_TOKENS, STOP_STRING, MAX_SEQ_LEN = "eos", "max_new_tokens", "stop_string", "max_seq_len"


@dataclass(frozen=True)
class Stops:
    """Where a decoder stops by itself, by the position of the verified token it just produced (its index in the
    whole sequence, prompt included): at an end-of-sequence token, at the `max_new_tokens`-th new token, or at the
    token the KV cache has no slot left to take in (position `capacity`)."""

    prompt_tokens: int
    max_new_tokens: int
    eos: Collection[int]
    capacity: int

    @property
    def last_position(self) -> int:
        """The position of the last token decoding may produce."""
        return min(self.prompt_tokens + self.max_new_tokens - 1, self.capacity)

    def after(self, token: int, position: int) -> str | None:
        """Why decoding stops after `token` at `position`, or None to go on."""
        if token in self.eos:
            return EOS
        if position >= self.prompt_tokens + self.max_new_tokens - 1:
            return MAX_NEW_TOKENS
        if position >= self.capacity:
            return MAX_SEQ_LEN
        return None


class Completion:
    """The verified tokens after a prompt, their text pieces, and the stop decision after each: the decoder's
    (`Stops`), else a stop string ending in the newest piece."""

    def __init__(self, prompt: list[int], config: GenerationConfig, tokenizer: TextTokenizer | None, with_text: bool):
        self.config = config
        self.text = TextStream(tokenizer, prompt) if tokenizer and (with_text or config.stop) else None
        self.longest_stop = max((len(s) for s in config.stop), default=0)
        self.tokens: list[int] = []
        self.margins: list[float] = []

    def push(self, token: int, margin: float, stop: str | None) -> tuple[str, str | None]:
        """Add a verified token and the decoder's stop decision after it: (the text it completes, why the
        completion stops here or None). A stop string the token completes outranks a full cache."""
        self.tokens.append(token)
        self.margins.append(margin)
        text, config = self.text, self.config
        piece = text.push(token) if text else ""
        if stop in (None, MAX_SEQ_LEN) and piece and config.stop and self._stop_string_in(piece):
            stop = STOP_STRING
        if text and stop:
            piece += text.finish()  # the last token: what was held back (a partial character) goes with it
        return piece, stop

    def _stop_string_in(self, piece: str) -> bool:
        """Whether a stop string ends in the newest piece: only the text it could span is looked at."""
        tail = self.text.text[-(len(piece) + self.longest_stop - 1) :]
        return any(s in tail for s in self.config.stop)
