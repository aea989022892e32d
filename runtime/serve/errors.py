"""The server's errors: each one a `ParadecodeError` that knows its HTTP status and OpenAI's error fields.

A refused request is answered with OpenAI's error object, `{"error": {"message", "type", "param",
"code"}}`: `type` is OpenAI's category ("invalid_request_error", ...), `param` names the request
field at fault (None where none is), `code` is a short machine-readable reason or None.

A response never shows where the export lies on the server's disk: `without_export_path` rewrites an error
from the runtime (which names files by their paths, for the operator's log) before it becomes an answer.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
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
    """The server holds all the work it admits: every replica busy and the queue full, or the request bodies waiting
    to be parsed and tokenized at their bound (429, with Retry-After)."""

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


def public_text(text: str, export: Path) -> str:
    """`text` with every path into `export` made relative to it ("onnx/weights.safetensors"), and the folder's own
    path replaced by its name: as given, absolute, and with its links resolved."""
    paths = {os.path.abspath(export), str(Path(export).resolve()), os.path.normpath(export)}
    for path in sorted(paths, key=len, reverse=True):  # a longer spelling first: one may hold another
        if path in (os.sep, os.curdir):  # "/" or ".": every path would lose its first separator
            continue
        text = text.replace(path + os.sep, "").replace(path, Path(path).name or "the export")
    return text


def without_export_path(err: BaseException, export: Path) -> BaseException:
    """`err`, or where its message names `export`'s path, a copy of it that does not (`public_text`): a paradecode
    error of the same class (the same answer), any other as a paradecode error that says what it was."""
    text = str(err)
    public = public_text(text, export)
    if public == text:
        return err
    if isinstance(err, ParadecodeError):
        hidden = copy.copy(err)
        hidden.args = (public,)
    else:
        hidden = ParadecodeError(f"internal error ({type(err).__name__}): {public}")
    hidden.__cause__ = err  # the log keeps the original, with its traceback
    return hidden
