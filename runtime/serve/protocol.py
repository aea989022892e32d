"""The connection side of paradecode-serve: the listening socket, and HTTP/1.1 with a request head bounded in time
and size, and framing errors answered in OpenAI's error format.

uvicorn bounds the idle wait between two requests (`timeout_keep_alive`), but not the time a client takes to send a
request's head: a client that sends half a header block and stops holds its connection for ever. `head_timed(seconds)`
is uvicorn's h11 protocol with that deadline: from the connection's start, and from the end of each response, the
request line and headers must all arrive within `seconds`, or the connection is closed. (The body has its own
deadline, in the app: app.py's `read_body`.)

The head's size: h11 refuses a head still arriving once its buffer passes 16 KiB (`max_incomplete_event_size`), but a
larger head that arrives whole in one read (100 KB over loopback) passed. `BoundedHeadConnection` also refuses a whole
head over HEAD_BYTES (16 KiB, measured as h11 parsed it: the request line and each `name: value` line) or with more
than HEAD_FIELDS header fields: 431, the connection closed.

Framing errors (a bad request line, `Content-Length: -1`, a bad chunk size, a head too large) are found by h11
before or while the app reads the body; uvicorn answers them itself with a plain-text 400. Here they get OpenAI's JSON
error object with h11's status (400, or 431), wherever no response has started; where one has (the app answered
before the body's end), the connection is only closed, as uvicorn does.

`listening_socket` binds the address before uvicorn starts, so that a bad `--host` and a taken
`--port` each get their own message (uvicorn logs the OSError and exits 1).
"""

from __future__ import annotations

import errno
import json
import os
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from paradecode.graphs.errors import UserInputError

HEAD_BYTES = 16 * 1024  # a request head's bytes: request line and header lines (h11's bound for a head arriving)
HEAD_FIELDS = 100  # header fields in one request (gunicorn's limit_request_fields; a client sends about 15)


class HeadTooLarge(h11.RemoteProtocolError):
    """A whole request head over HEAD_BYTES or HEAD_FIELDS (431)."""


class BoundedHeadConnection(h11.Connection):
    """h11's server side that refuses a whole request head over HEAD_BYTES or HEAD_FIELDS, and keeps the protocol
    error it raised last (`error`), for the answer."""

    def __init__(self):
        super().__init__(h11.SERVER, max_incomplete_event_size=HEAD_BYTES)
        self.error: h11.RemoteProtocolError | None = None
        self.method: bytes | None = None  # the last request's (a HEAD request's answer has no body)

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.error = err
            raise
        if isinstance(event, h11.Request):
            self.method = event.method
            size = head_bytes(event)
            if size > HEAD_BYTES or len(event.headers) > HEAD_FIELDS:
                self.error = HeadTooLarge(
                    f"the request's head is {size} bytes in {len(event.headers)} header fields; this server takes at "
                    f"most {HEAD_BYTES} bytes and {HEAD_FIELDS} fields: send fewer or shorter headers.",
                    error_status_hint=431,
                )
                raise self.error
        return event


def head_bytes(request: h11.Request) -> int:
    """The bytes of `request`'s head as h11 parsed it: "METHOD TARGET HTTP/1.1\r\n", a "name: value\r\n" line per
    field, and the blank line (the whitespace h11 strips around a value is not counted: about the bytes sent)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


def error_answer(err: h11.RemoteProtocolError | None) -> tuple[int, bytes]:
    """The status and OpenAI error body for a request h11 refused (`err`: its error, None where unknown)."""
    status = err.error_status_hint if err is not None else 400
    if status == 431:
        code = "request_header_fields_too_large"
        message = (
            str(err)
            if isinstance(err, HeadTooLarge)
            # h11's own: the head still arriving passed it
            else (
                f"the request's head passed {HEAD_BYTES} bytes before it ended; this server takes at most {HEAD_BYTES} "
                f"bytes and {HEAD_FIELDS} fields: send fewer or shorter headers."
            )
        )
    else:
        reason = f" ({err})" if err is not None and str(err) else ""
        message = f"malformed HTTP/1.1 request{reason}: send a valid request line, headers and framing."
        code = "malformed_request"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return status, json.dumps(body).encode()


class _HeadTimedH11Protocol(H11Protocol):
    head_timeout = 15.0  # set by `head_timed`

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = BoundedHeadConnection()  # in place of uvicorn's, before any byte arrives

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, as OpenAI's JSON error with h11's status; a connection whose
        response has started is only closed."""
        status, body = error_answer(self.conn.error)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers.append((b"connection", b"close"))
        try:
            data = self.conn.send(h11.Response(status_code=status, headers=headers))
            if self.conn.method != b"HEAD":  # h11 takes no body for a HEAD request's answer
                data += self.conn.send(h11.Data(data=body))
            data += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response has started: nothing more can be said on this connection
            data = b""
        if self.cycle is not None and not self.cycle.response_complete:  # the app's request ends here, as at a
            self.cycle.disconnected = True  # lost connection: its answer is not sent (uvicorn's connection_lost)
            self.cycle.message_event.set()
        self.transport.write(data)
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the whole head arrived: the app has the request now
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head, on this kept-alive connection

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head did not arrive within %g s", self.head_timeout)
            self.transport.close()


def head_timed(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (its `http=` setting) that closes a connection whose request head takes over `seconds`,
    refuses a head over HEAD_BYTES or HEAD_FIELDS, and answers framing errors with OpenAI's JSON error."""
    return type("HeadTimedH11Protocol", (_HeadTimedH11Protocol,), {"head_timeout": float(seconds)})


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port), or a UserInputError that says which of the two is wrong."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:  # UnicodeError: not a host name at all ("a..b", a label > 63)
        reason = err.strerror if isinstance(err, socket.gaierror) else f"not a valid host name: {err.__cause__ or err}"
        raise UserInputError(
            f"--host {host!r} is not an address or a host name this machine can resolve ({reason}): give one "
            "of this machine's addresses, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)."
        ) from None
    family, _, _, _, address = infos[0]
    try:
        return socket.create_server(address, family=family, backlog=2048)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)  # create_server's message repeats the address
        if err.errno == errno.EADDRINUSE:
            raise UserInputError(
                f"port {port} on {host} is taken ({reason}): choose another --port (0: any free port), or stop what "
                "listens there."
            ) from None
        if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise UserInputError(
                f"--host {host!r} is not an address of this machine ({reason}): give one of its addresses, e.g. "
                "127.0.0.1 or 0.0.0.0."
            ) from None
        if err.errno == errno.EACCES:
            raise UserInputError(
                f"port {port} needs privileges this process lacks ({reason}): choose one above 1023."
            ) from None
        raise UserInputError(f"cannot listen on {host}:{port} ({reason}).") from None
