"""`Completion`: one request's output as it grows, and when it stops. Shared by a model decoding one request
(`ParaDecodeModel`) and by a batch of requests (`runtime/batching.py`), so both stop alike.
"""

from __future__ import annotations

from collections.abc import Collection

from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.tokenizer import TextStream, TextTokenizer

# Why a completion stopped (GenerationStats.stop_reason); `closed` and `cancelled` are set by its caller.
EOS, MAX_NEW_TOKENS, STOP_STRING, MAX_SEQ_LEN = "eos", "max_new_tokens", "stop_string", "max_seq_len"


class Completion:
    """The verified tokens after a prompt, their text pieces, and the stop decision after each: an end-of-sequence
    token, `max_new_tokens`, a stop string ending in the newest piece, or a full KV cache (`capacity` slots)."""

    def __init__(
        self,
        prompt: list[int],
        config: GenerationConfig,
        tokenizer: TextTokenizer | None,
        eos: Collection[int],
        capacity: int,
        with_text: bool,
    ):
        self.config = config
        self.eos = eos
        self.text = TextStream(tokenizer, prompt) if tokenizer and (with_text or config.stop) else None
        self.longest_stop = max((len(s) for s in config.stop), default=0)
        self.room = capacity - len(prompt) + 1  # tokens the cache leaves after the prompt: the last one ends it
        self.tokens: list[int] = []
        self.margins: list[float] = []

    def push(self, token: int, margin: float) -> tuple[str, str | None]:
        """Add a verified token: (the text it completes, why the completion stops here or None)."""
        self.tokens.append(token)
        self.margins.append(margin)
        text, config = self.text, self.config
        piece = text.push(token) if text else ""
        if token in self.eos:
            stop = EOS
        elif len(self.tokens) >= config.max_new_tokens:
            stop = MAX_NEW_TOKENS
        elif piece and config.stop and self._stop_string_in(piece):
            stop = STOP_STRING
        elif len(self.tokens) >= self.room:
            stop = MAX_SEQ_LEN
        else:
            stop = None
        if text and stop:
            piece += text.finish()  # the last token: what was held back (a partial character) goes with it
        return piece, stop

    def _stop_string_in(self, piece: str) -> bool:
        """Whether a stop string ends in the newest piece: only the text it could span is looked at."""
        tail = self.text.text[-(len(piece) + self.longest_stop - 1) :]
        return any(s in tail for s in self.config.stop)
