"""OpenAI's response objects for one request: the whole response, or its stream of chunks.

Field names follow OpenAI's API and vLLM's extensions: `choices[0].stop_reason` (the stop string or
end-of-sequence token that ended the choice), `token_ids` / `prompt_token_ids` (with
`return_token_ids`). ParaDecode's own statistics of the request are in an extra top-level field,
`paradecode`: exits and accepted tokens per exit layer, lookup's proposed and accepted tokens, rollbacks, speed,
and why decoding stopped.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from paradecode.runtime.stats import GenerationResult

LENGTH_REASONS = ("max_new_tokens", "max_seq_len")


def finish_reason(result: GenerationResult, stop: str | None) -> str:
    """OpenAI's finish_reason: "stop" (a stop string or end of sequence), "length", or "abort" (vLLM's)."""
    if stop is not None or result.stats.stop_reason == "eos":
        return "stop"
    if result.stats.stop_reason in LENGTH_REASONS:
        return "length"
    return "abort"


def paradecode_stats(result: GenerationResult, queue_seconds: float) -> dict[str, Any]:
    stats = result.stats
    return {
        "mode": stats.mode,
        "overlap": stats.overlap,
        "exits_per_layer": {str(k): v for k, v in sorted(stats.exits_per_layer.items())},
        "accepted_per_layer": {str(k): v for k, v in sorted(stats.accepted_per_layer.items())},
        "lookup_proposed": stats.lookup_proposed,
        "lookup_accepted": stats.lookup_accepted,
        "rollbacks": stats.rollbacks,
        "tokens_per_second": stats.tokens_per_second,
        "queue_seconds": queue_seconds,
        "prefill_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "stop_reason": stats.stop_reason,
    }


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, new = result.stats.prompt_tokens, result.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event: `data: JSON` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


class Answer:
    """The response to one request; subclasses give the completion and the chat shapes."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool, include_usage: bool):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _stop_reason(self, result: GenerationResult, stop: str | None):
        if stop is not None:
            return stop
        return result.token_ids[-1] if result.stats.stop_reason == "eos" and result.token_ids else None

    def whole(self, result: GenerationResult, text: str, stop: str | None, queue_seconds: float) -> dict[str, Any]:
        choice = {
            "index": 0,
            **self._content(text),
            "logprobs": None,
            "finish_reason": finish_reason(result, stop),
            "stop_reason": self._stop_reason(result, stop),
        }
        if self.return_token_ids:
            choice["token_ids"] = result.token_ids
        body = {**self._head(self.object), "choices": [choice], "usage": usage(result)}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        body["paradecode"] = paradecode_stats(result, queue_seconds)
        return body

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token's (the chat's assistant role)."""
        return []

    def chunk(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        choice = {"index": 0, **self._delta(text), "logprobs": None, "finish_reason": None}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._chunk([choice])

    def last_chunks(
        self, result: GenerationResult, token_ids: list[int], stop: str | None, queue_seconds: float
    ) -> list[dict[str, Any]]:
        """The finish_reason and ParaDecode's statistics (the text went out with the tokens' chunks, the last token's
        with what it held back); then usage, if asked for."""
        choice = {
            "index": 0,
            **self._delta(""),
            "logprobs": None,
            "finish_reason": finish_reason(result, stop),
            "stop_reason": self._stop_reason(result, stop),
        }
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        last = self._chunk([choice])
        if self.return_token_ids:
            last["prompt_token_ids"] = self.prompt_ids
        last["paradecode"] = paradecode_stats(result, queue_seconds)
        chunks = [last]
        if self.include_usage:
            chunks.append({**self._head(self.chunk_object), "choices": [], "usage": usage(result)})
        return chunks

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(self.chunk_object), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def _content(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionAnswer(Answer):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _content(self, text: str) -> dict[str, Any]:
        return {"text": text}

    _delta = _content


class ChatAnswer(Answer):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _content(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [
            self._chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
        ]
