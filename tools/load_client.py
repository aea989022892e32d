"""The load of `paradecode-loadtest`: streamed OpenAI requests against running servers, in alternating rounds.

`load(targets, prompts, settings)` sends each target (a server, one per mode) `settings.warmup`
requests, reads its RSS, then `settings.requests` requests per target in `settings.rounds` rounds:
each round runs its share against every target in turn, the order reversed every other round, so
the targets are measured side by side in time. Request i of every target gets prompt i (modulo the
prompts) and, when sampling, seed i. Each request is one `Record`: time to the first chunk carrying
text, end-to-end latency, completion tokens (the server's final `usage` chunk), finish reason, or
the error it ended with.

Threading model: one thread. The requests are asyncio tasks on one event loop; a semaphore admits
`settings.concurrency` at once; each task owns its `Record`, and a target's figures (wall time,
RSS before and after) are written between rounds, when none of its requests is in flight; its peak RSS by one task
that reads every server's /metrics while the rounds run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from paradecode.graphs.errors import UserInputError
from paradecode.tools.server_process import ServerFailed, resident_bytes

RSS_EVERY = 0.5  # seconds between two reads of a server's resident memory while it is loaded
IDLE_SECONDS = 3.0  # a server's idle time before its RSS after the load is read


@dataclass(frozen=True)
class LoadSettings:
    """How much load, and what every request asks. Its fields are paradecode-loadtest's flags (`--max-tokens`)."""

    requests: int = 200  # per target
    concurrency: int = 8  # requests in flight at once
    rounds: int = 4  # at most `requests`
    warmup: int = 2  # requests per target before measuring, left out of the records
    max_tokens: int = 64
    temperature: float | None = None  # None: the server's default (greedy)
    ignore_eos: bool = False
    request_timeout: float = 600.0  # seconds

    def __post_init__(self) -> None:
        for name, least in (("requests", 1), ("concurrency", 1), ("rounds", 1), ("warmup", 0), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserInputError(f"{flag(name)} must be an integer of at least {least}, got {value!r}.")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise UserInputError(f"--temperature must be in [0, 2] (OpenAI's range), got {self.temperature:g}.")
        if not self.request_timeout > 0:
            raise UserInputError(
                f"--request-timeout must be a positive number of seconds, got {self.request_timeout:g}."
            )
        object.__setattr__(self, "rounds", min(self.rounds, self.requests))

    def edges(self) -> list[int]:
        """Where each round's requests begin and end: round r sends requests edges[r] to edges[r + 1] - 1."""
        return [self.requests * r // self.rounds for r in range(self.rounds + 1)]


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(kw_only=True)
class Record:
    """One request of the load: what it asked and what it got. Times in seconds."""

    target: str  # the mode the server ran
    round: int
    index: int  # the request's number within its target; it picks the prompt (index % prompts) and the seed
    endpoint: str  # "completions" or "chat"
    started: float = 0.0  # since the load began
    first_token_seconds: float | None = None  # to the first chunk carrying text (None: no text came)
    latency_seconds: float = 0.0  # to the end of the stream
    completion_tokens: int = 0
    tokens_from: str = "usage"  # "usage": the final usage chunk; "chunks": text chunks counted (no usage chunk)
    finish_reason: str | None = None
    error: str | None = None  # "ExceptionType: message"
    concurrency: int = 0  # requests in flight at once in its run
    text: str = ""  # the streamed answer


@dataclass
class Target:
    """A server to load: its name (the mode), its address, the model name it serves, and its figures."""

    name: str
    url: str
    client: Any = None  # an openai.AsyncOpenAI, while `load` runs
    model: str = ""
    wall_seconds: float = 0.0  # of its rounds
    rss_before: float | None = None  # bytes, after the warm-up
    rss_peak: float | None = None  # the most read while its requests ran (every RSS_EVERY seconds)
    rss_after: float | None = None  # once load ended and the server was idle IDLE_SECONDS


async def watch_peaks(targets: list[Target]) -> None:
    """Each target's resident memory every RSS_EVERY seconds, its most kept in `rss_peak`, until cancelled."""
    while True:
        for target in targets:
            value = await asyncio.to_thread(resident_bytes, target.url)
            if value is not None:
                target.rss_peak = max(value, target.rss_peak or 0.0)
        await asyncio.sleep(RSS_EVERY)


def request_of(prompt, index: int, settings: LoadSettings) -> tuple[str, dict[str, Any]]:
    """(endpoint, the `create` keyword arguments) of request `index`: a text to /v1/completions, a chat to
    /v1/chat/completions; streamed, with the usage chunk at the end."""
    body: dict[str, Any] = {
        "max_tokens": settings.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.temperature is not None:
        body.update(temperature=settings.temperature, seed=index)
    if settings.ignore_eos:
        body["extra_body"] = {"ignore_eos": True}  # vLLM's extension, which paradecode-serve takes
    if isinstance(prompt, str):
        return "completions", {"prompt": prompt, **body}
    return "chat", {"messages": prompt, **body}


async def send(client, model: str, record: Record, request: dict[str, Any], clock: float) -> None:
    """Send one streamed request and fill in `record`; a failed request is recorded in it, not raised."""
    import httpx
    import openai

    chat = record.endpoint == "chat"
    api = client.chat.completions if chat else client.completions
    start = time.perf_counter()
    record.started = start - clock
    counted, usage = 0, None
    try:
        async with await api.create(model=model, **request) as stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    piece = choice.delta.content if chat else choice.text
                    if piece:
                        record.text += piece
                        counted += 1
                        if record.first_token_seconds is None:
                            record.first_token_seconds = time.perf_counter() - start
                    record.finish_reason = choice.finish_reason or record.finish_reason
        if record.finish_reason is None:
            record.error = "IncompleteStream: the stream ended without a finish_reason"
    except (openai.APIError, httpx.HTTPError) as err:  # openai wraps its transport's errors; older versions did not
        record.error = f"{type(err).__name__}: {err}"
    record.latency_seconds = time.perf_counter() - start
    record.completion_tokens, record.tokens_from = (usage, "usage") if usage is not None else (counted, "chunks")


async def served_model(target: Target) -> str:
    """The model name the server serves (the first of /v1/models)."""
    import httpx
    import openai

    try:
        models = (await target.client.models.list()).data
    except (openai.APIError, httpx.HTTPError) as err:
        raise ServerFailed(f"{target.url}/v1/models: {type(err).__name__}: {err}") from err
    if not models:
        raise ServerFailed(f"{target.url}/v1/models lists no model.")
    return models[0].id


async def load(targets: list[Target], prompts: list, settings: LoadSettings) -> list[Record]:
    """Warm every target up, read its RSS, send the rounds (alternating targets), read the RSS again.

    Fills in each target's figures and returns every measured request's record (the warm-up's are left out;
    a failed warm-up request raises `ServerFailed`)."""
    import openai

    clock = time.perf_counter()
    records: list[Record] = []
    semaphore = asyncio.Semaphore(settings.concurrency)

    async def batch(target: Target, indices: range, round_: int, bar=None) -> list[Record]:
        async def one(index: int) -> Record:
            endpoint, request = request_of(prompts[index % len(prompts)], index, settings)
            record = Record(
                target=target.name, round=round_, index=index, endpoint=endpoint, concurrency=settings.concurrency
            )
            async with semaphore:
                await send(target.client, target.model, record, request, clock)
            if bar is not None:
                bar.update()
            return record

        return list(await asyncio.gather(*(one(i) for i in indices)))

    for target in targets:
        target.client = openai.AsyncOpenAI(
            base_url=f"{target.url}/v1", api_key="unused", max_retries=0, timeout=settings.request_timeout
        )
    try:
        for target in targets:
            target.model = await served_model(target)
            for record in await batch(target, range(settings.warmup), -1):
                if record.error is not None:
                    raise ServerFailed(f"{target.name}: a warm-up request failed: {record.error}")
            target.rss_before = await asyncio.to_thread(resident_bytes, target.url)
        edges = settings.edges()
        watching = asyncio.create_task(watch_peaks(targets))
        with tqdm(total=settings.requests * len(targets), desc="loading", unit="req") as bar:
            for r in range(settings.rounds):
                for target in targets if r % 2 == 0 else targets[::-1]:
                    bar.set_postfix(mode=target.name, round=f"{r + 1}/{settings.rounds}")
                    started = time.perf_counter()
                    records += await batch(target, range(edges[r], edges[r + 1]), r, bar)
                    target.wall_seconds += time.perf_counter() - started
        watching.cancel()
        await asyncio.sleep(IDLE_SECONDS)
        for target in targets:
            target.rss_after = await asyncio.to_thread(resident_bytes, target.url)
    finally:
        for target in targets:
            await target.client.close()
            target.client = None
    return records
