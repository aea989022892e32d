"""The FastAPI app: OpenAI's `/v1/models`, `/v1/completions`, `/v1/chat/completions`, and `/health`, `/metrics`.

`build_app(service)` serves a running `Service` (its owner closes it); `app_from_config(config)`
makes an app that loads its own service at startup and closes it at shutdown (the ASGI lifespan),
which is how a Ray Serve replica runs it. Every error is answered with OpenAI's error object.

A generation request's time is bounded from its arrival (its head complete): its body must arrive
within `read_timeout` (408, and the connection is closed), parsing and tokenizing run in the service's
preparation threads, never on the event loop, and everything up to the last token within
`request_timeout` (504). No interactive docs (`/docs`, `/redoc`, `/openapi.json`), and no redirect
to a path with or without a trailing slash (it would be built from the client's Host header).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from paradecode.graphs.errors import ExportChangedError, ManifestError
from paradecode.runtime.serve.bodies import ChatCompletionRequest, CompletionRequest
from paradecode.runtime.serve.config import ServeConfig
from paradecode.runtime.serve.errors import (
    BodyTimeout,
    BodyTooLarge,
    HTTPError,
    RequestError,
    public_text,
    without_export_path,
)
from paradecode.runtime.serve.generation import (
    ClientGone,
    Follower,
    error_response,
    http_error_of,
    outcome_of,
    streamed,
    whole,
)
from paradecode.runtime.serve.responses import Answer, ChatAnswer, CompletionAnswer
from paradecode.runtime.serve.service import Service
from paradecode.runtime.serve.shutdown import ShutdownGuard

logger = logging.getLogger(__name__)

ENDPOINTS = {
    "completions": (CompletionRequest, CompletionAnswer),
    "chat": (ChatCompletionRequest, ChatAnswer),
}


def build_app(service: Service) -> FastAPI:
    """The app over `service`, which the caller keeps and closes."""
    app = new_app()
    app.state.service = service
    return app


def app_from_config(config: ServeConfig) -> FastAPI:
    """An app that loads `config`'s replicas at startup and frees them at shutdown (for Ray Serve, or
    `uvicorn --factory`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service = await asyncio.to_thread(Service, config)
        app.state.service = service
        try:
            yield
        finally:
            await asyncio.to_thread(service.close)

    return new_app(lifespan)


def new_app(lifespan=None) -> FastAPI:
    app = FastAPI(
        title="paradecode",
        summary="OpenAI-compatible ParaDecode server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(StarletteHTTPException, route_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(ShutdownGuard)
    return app


def service_of(request: Request) -> Service:
    return request.app.state.service


async def models(request: Request) -> JSONResponse:
    service = service_of(request)
    manifest = service.reference.manifest
    card = {
        "id": service.config.served_model_name,
        "object": "model",
        "created": int(service.started),
        "owned_by": "paradecode",
        "root": service.config.served_model_name,  # never the export's path on this server's disk
        "parent": None,
        "max_model_len": service.capacity,  # vLLM's name for the positions a request may take
        "paradecode": {"exit_layers": list(manifest.exit_layers), "replicas": service.config.replicas},
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> JSONResponse:
    """200 with the queue's state once the replicas are loaded, until the server stops; 503 `export_changed` while
    the served folder does not hold the export the replicas loaded (they start no request: restart the server)."""
    service = service_of(request)
    waiting, running = service.pool.counts()
    state = {
        "replicas": service.config.replicas,
        "waiting": waiting,
        "running": running,
        "kv_cache_bytes_max": service.pool.kv_cache_bytes,  # every row of every replica at max_seq_len
    }
    try:  # in a thread: a file whose stat changed is hashed, which must not hold the event loop
        await asyncio.to_thread(service.check_export)
    except ExportChangedError as err:
        message = public_text(str(err), service.config.export)  # never the export's path on this disk
        return JSONResponse({"status": "export_changed", "message": message, **state}, status_code=503)
    return JSONResponse({"status": "ok", **state})


async def metrics(request: Request) -> Response:
    service = service_of(request)
    return Response(service.metrics.render(), media_type=service.metrics.content_type)


async def completions(request: Request) -> Response:
    return await generate(request, "completions")


async def chat_completions(request: Request) -> Response:
    return await generate(request, "chat")


async def generate(request: Request, endpoint: str) -> Response:
    """Read, prepare and queue the request, then answer it whole or streamed; count its outcome once."""
    arrived = time.monotonic()
    service = service_of(request)
    config = service.config
    kind, answer_class = ENDPOINTS[endpoint]
    record = lambda outcome: service.metrics.request(endpoint, outcome, time.monotonic() - arrived)
    follow = None
    try:
        body = await read_body(request, config.max_body_bytes, min(config.read_timeout, config.request_timeout))
        parsed, resolved = await service.prepare_body(kind, body, arrived + config.request_timeout)
        job = service.submit(resolved, arrived)
        follow = Follower(service.pool, job, request, config.request_timeout)
        answer: Answer = answer_class(
            config.served_model_name, list(resolved.ids), parsed.return_token_ids, parsed.include_usage
        )
        if parsed.stream:
            response = await streamed(follow, answer, record)
            follow = None  # the stream owns it now, and records the outcome when it ends
            return response
        response = await whole(follow, answer)
        record("success")
        return response
    except ClientGone as err:
        logger.info("%s %s: the client left (%s)", request.method, request.url.path, err)
        record(outcome_of(err))
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    except asyncio.CancelledError:  # the server cancelled the request (shutdown): ShutdownGuard answers it
        record("cancelled")
        raise
    except Exception as err:
        error = http_error_of(err)
        if isinstance(err, ExportChangedError):
            pass  # logged once when the change was found (runtime/watched.py); each refusal is counted below
        elif isinstance(err, ManifestError):  # the export is broken: the message says it all
            logger.error("refused a request: %s", err)
        elif error.status >= 500 and not isinstance(err, HTTPError):
            logger.error("request failed", exc_info=err)
        record(outcome_of(error))
        return error_response(error, config.retry_after)
    finally:
        if follow is not None:
            follow.close()


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body: at most `limit` bytes (413 beyond, before reading it all), within `timeout` s (408).

    A client that leaves while sending it raises ClientGone.
    """
    declared = request.headers.get("content-length", "")
    too_large = lambda size: BodyTooLarge(
        f"the request body has {size} bytes, more than this server accepts ({limit}).", code="request_too_large"
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared))
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_large(f"more than {len(body)}")

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeout(
            f"the request body did not arrive within {timeout:g} s ({len(body)} bytes came); this server closes "
            "connections that send their body more slowly. Send the whole body at once."
        ) from None
    except ClientDisconnect:
        raise ClientGone(f"it left while sending its body, after {len(body)} bytes") from None
    if not body:
        raise RequestError("the request has no body: send a JSON object.")
    return bytes(body)


async def route_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404) and methods (405), as OpenAI's error object."""
    error = RequestError(f"{request.method} {request.url.path}: {err.detail}.")
    return JSONResponse(error.body(), status_code=err.status_code, headers=getattr(err, "headers", None))


async def internal_error(request: Request, err: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
    service = getattr(request.app.state, "service", None)
    error = http_error_of(err if service is None else without_export_path(err, service.config.export))
    return JSONResponse(error.body(), status_code=error.status)
