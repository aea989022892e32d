"""One generation request on the event loop: follow its job, answer whole or as Server-Sent Events.

Everything here runs on the event loop and never blocks: a job's events arrive on its
`asyncio.Queue` (see pool.py's threading model). A request ends in one of three ways, each of which
cancels its job (a running job frees its replica after the token being computed):

- its last event (the result, or the runtime's error);
- the request timeout, counted from arrival (queueing included): 504, or an error event in a stream;
- the client leaving: a task waits for the ASGI `http.disconnect` message, cancels the job at once,
  and wakes the reader.

A stream's status line is sent only once the first event is in, so a request that fails before its
first token (a timeout in the queue, the server shutting down) still gets its HTTP status; later
errors arrive as one `data: {"error": ...}` event before `data: [DONE]`, as vLLM sends them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paradecode.graphs.errors import (
    ExportChangedError,
    ManifestError,
    ModelClosedError,
    ParadecodeError,
    UserInputError,
)
from paradecode.runtime.engine import StreamedToken
from paradecode.runtime.serve.errors import (
    BodyTimeout,
    BodyTooLarge,
    HTTPError,
    QueueFull,
    RequestError,
    RequestTimeout,
    ServiceUnavailable,
)
from paradecode.runtime.serve.pool import Job, ReplicaPool
from paradecode.runtime.serve.responses import Answer, sse
from paradecode.runtime.stats import GenerationResult

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection (not an error: the request is counted as cancelled)."""


def http_error_of(err: BaseException) -> HTTPError:
    """The HTTP answer to an error raised while serving a request."""
    if isinstance(err, HTTPError):
        return err
    if isinstance(err, ModelClosedError):
        return ServiceUnavailable(f"the replica was closed while serving this request: {err}")
    if isinstance(err, ExportChangedError):
        return ServiceUnavailable(f"this server no longer serves its folder's export: {err}", code="export_changed")
    if isinstance(err, UserInputError):
        return RequestError(str(err))
    if isinstance(err, ManifestError):
        return HTTPError(f"the served export is broken: {err}")
    if isinstance(err, ParadecodeError):
        return HTTPError(str(err))
    return HTTPError(f"internal error ({type(err).__name__}): {err}")


def outcome_of(err: BaseException) -> str:
    """The `outcome` label of a request that ended with `err`."""
    if isinstance(err, ClientGone):
        return "cancelled"
    if isinstance(err, QueueFull):
        return "rejected"
    if isinstance(err, (RequestTimeout, BodyTimeout)):
        return "timeout"
    if isinstance(err, ServiceUnavailable):
        return "unavailable"
    if isinstance(err, RequestError):
        return "invalid"
    return "error"


def error_response(err: HTTPError, retry_after: int) -> JSONResponse:
    headers = {}
    if isinstance(err, QueueFull):
        headers["Retry-After"] = str(retry_after)
    if isinstance(err, (BodyTooLarge, BodyTimeout)):
        headers["Connection"] = "close"  # the rest of the body is not read: the connection cannot carry another request
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


class Follower:
    """Reads one job's events for its HTTP request until the last one, the deadline, or the client leaves."""

    def __init__(self, pool: ReplicaPool, job: Job, request: Request, timeout: float):
        self.pool = pool
        self.job = job
        self.request = request
        self.timeout = timeout
        self.deadline = job.arrived + timeout
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.pool.cancel(self.job)
        self.job.events.put_nowait(ClientGone("it closed the connection"))

    async def next(self) -> StreamedToken | GenerationResult:
        """The next event; raises ClientGone, RequestTimeout, or the HTTP form of the runtime's error."""
        try:
            event = await asyncio.wait_for(self.job.events.get(), max(self.deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"the request did not finish within {self.timeout:g} s (the server's request timeout, queueing "
                "included) and was cancelled. Ask for fewer tokens or retry when the server is less busy."
            ) from None
        if isinstance(event, ClientGone):
            raise event
        if isinstance(event, BaseException):
            raise http_error_of(event)
        return event

    def close(self) -> None:
        """Stop watching and cancel the job (nothing happens to a finished one). Idempotent."""
        self._watcher.cancel()
        self.pool.cancel(self.job)


async def whole(follow: Follower, answer: Answer) -> JSONResponse:
    """The response once the job has finished."""
    while not isinstance(result := await follow.next(), GenerationResult):
        pass
    return JSONResponse(answer.whole(result, result.shown_text or "", result.stop_string, follow.job.queue_seconds))


async def streamed(follow: Follower, answer: Answer, record) -> StreamingResponse:
    """A Server-Sent Events response, started once the first event is in; `record(outcome)` is called at its end."""
    first = await follow.next()
    return StreamingResponse(events(follow, answer, first, record), media_type="text/event-stream", headers=SSE_HEADERS)


async def events(
    follow: Follower, answer: Answer, event: StreamedToken | GenerationResult, record
) -> AsyncIterator[bytes]:
    outcome = "error"
    token_ids: list[int] = []  # verified since the last chunk
    try:
        for chunk in answer.first_chunks():
            yield sse(chunk)
        while isinstance(event, StreamedToken):
            token_ids.append(event.token)
            if event.shown or answer.return_token_ids:
                yield sse(answer.chunk(event.shown, token_ids))
                token_ids = []
            event = await follow.next()
        result = event
        for chunk in answer.last_chunks(result, token_ids, result.stop_string, follow.job.queue_seconds):
            yield sse(chunk)
        yield sse("[DONE]")
        outcome = "success"
    except ClientGone:
        outcome = "cancelled"
    except asyncio.CancelledError:  # the server cancelled the response: the client left, or shutdown
        outcome = "cancelled"
        raise
    except HTTPError as err:
        outcome = outcome_of(err)
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        follow.close()
        record(outcome)
