"""Shutdown that answers every open request: `GracefulServer` (uvicorn's Server) and `ShutdownGuard` (ASGI).

What docs/serving.md promises on SIGTERM, Ctrl-C, or uvicorn's `should_exit`: new connections are
refused, in-flight requests get `--shutdown-timeout` seconds to finish, and whatever is still open
then gets an answer: a request whose response has not started gets 503 JSON (`shutting_down`), a
stream gets a last `data: {"error": ...}` event and `data: [DONE]`.

uvicorn alone cancels the requests' tasks when its graceful-shutdown timeout ends, which gives a
plain-text 500, cuts streams without an end, and logs "Exception in ASGI application" for each. So:

1. `GracefulServer.shutdown` starts a watcher: at `shutdown_timeout` (at once on a second Ctrl-C,
   uvicorn's force exit) it drains the pool (`ReplicaPool.drain`): every waiting and running job
   fails with ServiceUnavailable, which the request's own code answers (503, or the error event).
   uvicorn's own timeout is set DRAIN_GRACE seconds later, so those answers go out first.
2. `ShutdownGuard`, the app's outermost middleware, catches the cancellation uvicorn (or the end of
   the event loop) still delivers to a request that did not end in time (a client that stopped
   reading, a body still arriving) and sends the same answer within LAST_WORDS_SECONDS. It ends the
   request's task normally: the cancellation was the server's way of ending that request.
"""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn

from paradecode.runtime.serve.errors import ServiceUnavailable

logger = logging.getLogger(__name__)

DRAIN_GRACE = 2.0  # seconds between draining the pool and uvicorn cancelling what is left
LAST_WORDS_SECONDS = 1.0  # for ShutdownGuard's answer to a cancelled request
SHUTTING_DOWN = "the server is shutting down (its --shutdown-timeout ended): retry, on another replica if there is one"


def shutting_down() -> ServiceUnavailable:
    return ServiceUnavailable(f"{SHUTTING_DOWN}.")


class GracefulServer(uvicorn.Server):
    """uvicorn's Server over `service`: drains the pool `shutdown_timeout` s after shutdown begins.

    Give its uvicorn config `timeout_graceful_shutdown=graceful_timeout(shutdown_timeout)`.
    """

    def __init__(self, config: uvicorn.Config, service, shutdown_timeout: float):
        super().__init__(config)
        self.service = service
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        watcher = asyncio.create_task(self._drain_when_due())
        try:
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn stopped waiting: let the drained requests send their answers, and end
                await self._drained_requests_end()  # the app's lifespan (uvicorn skips it), which would otherwise
                await asyncio.wait_for(self.lifespan.shutdown(), DRAIN_GRACE)  # be cancelled with a traceback
        finally:
            watcher.cancel()

    async def _drain_when_due(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.shutdown_timeout
        while loop.time() < due and not self.force_exit:
            await asyncio.sleep(0.05)
        failed = self.service.pool.drain(SHUTTING_DOWN)
        if failed:
            logger.warning("shutdown: answered %d unfinished request(s) with 503 (--shutdown-timeout)", failed)

    async def _drained_requests_end(self) -> None:
        self.service.pool.drain(SHUTTING_DOWN)
        tasks = set(self.server_state.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=DRAIN_GRACE)


def graceful_timeout(shutdown_timeout: float) -> float:
    """uvicorn's `timeout_graceful_shutdown` for a server that drains at `shutdown_timeout`."""
    return shutdown_timeout + DRAIN_GRACE


class ShutdownGuard:
    """ASGI middleware: a request cancelled by the server still gets 503 JSON, or a stream's error event and [DONE]."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = {"started": False, "ended": False, "stream": False}

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                response["started"] = True
                headers = dict(message.get("headers") or [])
                response["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+: this task is not being cancelled now
                task.uncancel()
            if response["ended"]:
                return
            try:
                await asyncio.wait_for(last_words(send, response), LAST_WORDS_SECONDS)
            except (asyncio.TimeoutError, OSError) as err:
                logger.info("shutdown: could not answer %s %s (%s)", scope["method"], scope["path"], type(err).__name__)
            else:
                logger.info("shutdown: answered %s %s with 503", scope["method"], scope["path"])


async def last_words(send, response: dict) -> None:
    """The answer to a request the server ends: 503 JSON before its response started, else a stream's last events."""
    error = shutting_down().body()
    if not response["started"]:
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})
    elif response["stream"]:
        body = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": body})
    else:
        await send({"type": "http.response.body", "body": b""})  # a response cut short: end it
