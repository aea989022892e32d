"""The connection side of paradecode-serve: the listening socket, and HTTP/1.1 with a deadline for a request's head.

uvicorn bounds the idle wait between two requests (`timeout_keep_alive`) and the size of a request's
head (h11's `max_incomplete_event_size`, 16 KiB), but not the time a client takes to send that head:
a client that sends half a header block and stops holds its connection for ever. `head_timed(seconds)`
is uvicorn's h11 protocol with that deadline: from the connection's start, and from the end of each
response, the request line and headers must all arrive within `seconds`, or the connection is
closed. (The body has its own deadline, in the app: app.py's `read_body`.)

`listening_socket` binds the address before uvicorn starts, so that a bad `--host` and a taken
`--port` each get their own message (uvicorn logs the OSError and exits 1).
"""

from __future__ import annotations

import errno
import os
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from paradecode.graphs.errors import UserInputError


class _HeadTimedH11Protocol(H11Protocol):
    head_timeout = 15.0  # set by `head_timed`

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
    """uvicorn's h11 protocol (its `http=` setting) that closes a connection whose request head takes over `seconds`."""
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
