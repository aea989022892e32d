"""When a request's output stops. The token-level rules (`Stops`: an end-of-sequence token, `max_new_tokens`, a
full KV cache) belong to the decoders: plain decoding and ParaDecode each take a request's `Stops`, decide after
every verified token and end there (ParaDecode also speculates no further). The text-level rule (a stop string)
belongs to `Completion`, the output's tokens and text as they grow, which finds stop strings with `StopText`. Both
are shared by every engine step (runtime/engine.py), so every path stops alike.

Stop strings live here alone: `StopText` finds the first stop string in a growing text and, as OpenAI's API
returns text, cuts the text before it and, while streaming, holds back the end of the text that could still
become one. The runtime's result keeps the text it decoded (the stop string included, as Hugging Face's
`generate` does) beside the shown text and the stop string; `paradecode-serve` only formats them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

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

    @staticmethod
    def room(prompt_tokens: int, capacity: int) -> int:
        """The new tokens a prompt of `prompt_tokens` leaves room for in a KV cache of `capacity` slots: one for each
        free slot, and the last token, which no later position reads, so it is never stored (a prompt that fills
        the cache still gets one). 0 or less: the prompt is longer than the cache."""
        return capacity - prompt_tokens + 1

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
    (`Stops`), else a stop string ending in the newest piece. The text is kept twice: as decoded (`text`: the stop
    string included, as Hugging Face's `generate` returns it) and as OpenAI's API shows it (`shown`: cut before the
    first stop string, released piece by piece without any part of one), so a stop string is found once, here."""

    def __init__(self, prompt: list[int], stop: tuple[str, ...], tokenizer: TextTokenizer | None, with_text: bool):
        self.text = TextStream(tokenizer, prompt) if tokenizer and (with_text or stop) else None
        self.shown = StopText(stop)  # where the first stop string is, once there is one
        self.tokens: list[int] = []
        self.margins: list[float] = []

    def push(self, token: int, margin: float, stop: str | None) -> tuple[str, str, str | None]:
        """Add a verified token and the decoder's stop decision after it: (the text it completes, the part of the
        shown text it releases, why the completion stops here or None). A stop string the token completes outranks
        a full cache."""
        self.tokens.append(token)
        self.margins.append(margin)
        text, shown = self.text, self.shown
        if text is None:
            return "", "", stop
        piece = text.push(token)
        released = shown.push(piece)
        if stop in (None, MAX_SEQ_LEN) and shown.stop is not None:
            stop = STOP_STRING
        if stop:
            rest = text.finish()  # the last token: what was held back (a partial character) goes with it
            piece += rest
            released += shown.push(rest) + shown.finish()
        return piece, released, stop

    @property
    def stop_string(self) -> str | None:
        """The stop string the text stopped at (None: none did)."""
        return self.shown.stop


class StopText:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.text = ""  # everything pushed
        self.sent = 0  # text[:sent] has been released
        self.stop: str | None = None  # the stop string found, once found
        self._cut: int | None = None

    def push(self, piece: str) -> str:
        """Add a piece of text; return what may be sent now."""
        if self.stop is not None:
            return ""
        self.text += piece
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest + 1)  # a stop string may begin in text already released
        found = [(at, s) for s in self.stops if (at := self.text.find(s, start)) >= 0]
        if found:
            self._cut, self.stop = min(found)
            return self._release(self._cut)
        return self._release(len(self.text) - self._held())

    def finish(self, final_text: str | None = None) -> str:
        """The rest of the text once decoding is done; `final_text`, the whole decoded text, may extend it."""
        released = ""
        if self.stop is None and final_text is not None and final_text.startswith(self.text):
            released = self.push(final_text[len(self.text) :])  # e.g. a last character the stream held back
        end = self._cut if self.stop is not None else len(self.text)
        return released + self._release(end)

    @property
    def result(self) -> str:
        return self.text[: self._cut] if self.stop is not None else self.text

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string (it may still become one)."""
        tail = self.text[max(0, self.sent) :]
        for size in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-size:]) for s in self.stops):
                return size
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece
