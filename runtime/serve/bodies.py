"""OpenAI request bodies: parsed, checked, and mapped onto the runtime's `GenerationConfig`.

A body is untrusted: it is parsed as JSON by pydantic in strict mode (no "16" for 16, no 16.0, no
true for 1), unknown fields are refused, and every error names the field. What fails:

- malformed JSON: 400; JSON that does not fit the schema (a wrong type, a missing or unknown field,
  a value outside OpenAI's documented range): 422 (`InvalidRequest`);
- a valid value this server does not support (n > 1, logprobs, tools): 400.

`CONFIG_FIELDS` lists the request fields passed on to `GenerationConfig` (sampling included:
temperature, top_p, top_k, seed; the runtime samples losslessly, runtime/sampling.py), `CONVERT` how a
value is translated on the way (vLLM's top_k -1 is our 0; OpenAI's seed may be negative, ours is a
non-negative integer).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paradecode.graphs.arguments import SEED_RANGE, seed_of
from paradecode.runtime.serve.errors import InvalidRequest, RequestError

# Request field -> GenerationConfig field.
CONFIG_FIELDS = {
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
}
# GenerationConfig field -> the request field that sets it, for an error that names it.
REQUEST_FIELDS = {config: field for field, config in CONFIG_FIELDS.items()} | {"max_new_tokens": "max_tokens"}
# Request field -> how its value becomes the GenerationConfig field's.
CONVERT = {"top_k": lambda k: 0 if k == -1 else k, "seed": seed_of}
# OpenAI fields this server does not implement: accepted only at their "off" values.
UNSUPPORTED_UNLESS = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
MAX_STOP_STRINGS = 4  # OpenAI's limit
# Union fields: pydantic puts the member's type name after them in an error's location; these say what is expected.
UNION_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list holding one string or one list of token ids",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "content": 'a string or a list of {"type": "text", "text": "..."} parts',
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str
    content: str | list[TextPart]
    name: str | None = None  # OpenAI's; refused when set (a chat template sees role and content only)

    def plain(self, index: int) -> dict[str, str]:
        if self.name is not None:
            raise RequestError(
                f"messages[{index}].name is not supported: the model's chat template sees only role and content.",
                f"messages[{index}].name",
            )
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class GenerationRequest(Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None  # a string of any length
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # of the sampling draws
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)  # 0 would keep no token
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1 (or 0) keeps every token
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0, ge=-2, le=2)
    frequency_penalty: float = Field(0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id, for the client's bookkeeping only
    ignore_eos: bool = False  # vLLM's: keep generating after an end-of-sequence token
    return_token_ids: bool = False  # vLLM's: the token ids of the prompt and of the choice in the response

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the new tokens asked for or None, the field that asked)."""
        return self.max_tokens, "max_tokens"

    def default_max_tokens(self, completion_default: int) -> int | None:
        """New tokens when the request sets none; None: what the context leaves (vLLM's chat default)."""
        return None

    def check_supported(self) -> None:
        """Refuse (400) values that are valid in OpenAI's API but that this server does not implement."""
        for name, allowed in UNSUPPORTED_UNLESS.items():
            value = getattr(self, name, None)
            if value is not None and value not in allowed:
                raise RequestError(
                    f"{name} {value!r} is not supported by this server; "
                    f"send {' or '.join(repr(a) for a in allowed if a is not None) or 'null'} or leave it out"
                    + (" (one choice per request: send n requests)." if name in ("n", "best_of") else "."),
                    name,
                )
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise RequestError("stop strings must not be empty.", "stop")

    def config_settings(self) -> dict[str, Any]:
        """The GenerationConfig fields this request sets (besides max_new_tokens, which needs the prompt's length)."""
        settings = {}
        for name, target in CONFIG_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                value = CONVERT[name](value) if name in CONVERT else value
                settings[target] = tuple(value) if isinstance(value, list) else value
        return settings


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def default_max_tokens(self, completion_default: int) -> int | None:
        return completion_default  # OpenAI's completions default (16)

    def prompt_kwargs(self) -> dict[str, Any]:
        """The runtime's prompt argument: `prompt` (text) or `prompt_ids`; one prompt per request."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError(
                    f"prompt holds {len(prompt)} prompts; this server takes one prompt per request.", "prompt"
                )
            prompt = prompt[0]
        return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": list(prompt)}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def prompt_kwargs(self) -> dict[str, Any]:
        return {"messages": [message.plain(i) for i, message in enumerate(self.messages)]}


def parse_request(kind: type[GenerationRequest], body: bytes) -> GenerationRequest:
    """The request in `body`, or a RequestError (400: not JSON) / InvalidRequest (422: not the schema)."""
    try:
        request = kind.model_validate_json(body, strict=True)
    except ValidationError as err:
        raise error_of(err) from None
    return request


def error_of(err: ValidationError) -> RequestError:
    """One error for the client: the first problem pydantic found, named by its field."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first['msg']}.", code="invalid_json")
    if first["type"] == "model_type":
        return InvalidRequest(f"the request body must be a JSON object, got {type(first['input']).__name__}.")
    path, union = "", None
    loc = list(first["loc"])
    while loc:
        part = loc.pop(0)
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        union = None
        if part in UNION_EXPECTED and loc and isinstance(loc[0], str):
            union = part
            loc.pop(0)  # the union member's type name
    given = first.get("input")
    if first["type"] == "extra_forbidden":
        return InvalidRequest(f"unknown field {path!r}: it is not part of this endpoint's request.", path)
    if first["type"] == "missing":
        return InvalidRequest(f"{path} is required.", path)
    if union is not None:  # the error is about the union field itself, not inside one of its members
        return InvalidRequest(f"{path} must be {UNION_EXPECTED[union]}; got {describe(given)}.", path)
    return InvalidRequest(f"{path}: {first['msg'][0].lower()}{first['msg'][1:]}; got {describe(given)}.", path)


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
