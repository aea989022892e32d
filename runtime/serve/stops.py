"""Stop strings as OpenAI applies them: the text ends before the first stop string, which is not returned.

The runtime stops decoding once its text holds a stop string; the text it returns still holds it.
`StopText` cuts it off, and while streaming holds back the end of the text that could be the start
of a stop string, so no piece of one ever reaches the client.
"""

from __future__ import annotations


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


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(`text` up to the first stop string, that stop string or None)."""
    stop_text = StopText(stops)
    stop_text.push(text)
    stop_text.finish()
    return stop_text.result, stop_text.stop
