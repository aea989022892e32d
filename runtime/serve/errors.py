"""The server's errors: each one a `ParadecodeError` that knows its HTTP status and OpenAI's error fields.

A refused request is answered with OpenAI's error object, `{"error": {"message", "type", "param",
"code"}}`: `type` is OpenAI's category ("invalid_request_error", ...), `param` names the request
field at fault (None where none is), `code` is a short machine-readable reason or None.
"""

from __future__ import annotations

from typing import Any

from paradecode.graphs.errors import ParadecodeError, UserInputError


class HTTPError(ParadecodeError):
    """An error with an HTTP answer. Subclasses set `status`, `type` and a default `code`."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class RequestError(HTTPError, UserInputError):
    """The client's mistake: a value this server does not accept (400)."""

    status = 400
    type = "invalid_request_error"


class InvalidRequest(RequestError):
    """Well-formed JSON that does not fit the request's schema: a wrong type, a missing or unknown field (422)."""

    status = 422


class ModelNotFound(RequestError):
    status = 404
    code = "model_not_found"


class PromptTooLong(RequestError):
    """The prompt does not fit the export's KV cache with room for one new token (413)."""

    status = 413
    code = "context_length_exceeded"


class BodyTooLarge(RequestError):
    status = 413
    code = "request_too_large"


class QueueFull(HTTPError):
    """Every replica is busy and the queue is full (429, with Retry-After)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class RequestTimeout(HTTPError):
    """The request did not finish within the server's request timeout (504)."""

    status = 504
    code = "timeout"


class BodyTimeout(RequestError):
    """The client did not send its whole body in time (408; the connection is closed)."""

    status = 408
    code = "request_timeout"


class ServiceUnavailable(HTTPError):
    """The server is shutting down, or cannot decode safely any more (503)."""

    status = 503
    code = "shutting_down"
