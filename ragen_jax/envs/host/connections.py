"""What the env server's HTTP connections may hold: uvicorn's h11 protocol with a header
timeout and a cap on open connections (``ConnectionGuard``), which uvicorn has no settings for.

uvicorn closes a connection idle after a response (``timeout_keep_alive``), but any byte of a
next request stops that clock, and a fresh connection has none: a client that opens
connections and sends half a request line holds each one (and its file descriptor) for ever,
and when the process runs out of descriptors nobody else gets in. ``limit_concurrency`` does
not help: it answers ``503`` to the requests of every client once the connections reach it.
So here:

* a connection must complete a request's headers within ``header_timeout`` seconds of
  opening or of its last response, else it is closed;
* at most ``max_connections`` are open: a new connection past it closes the connection that
  has waited longest between requests (its headers not yet complete, or idle after a
  response), those that have not shown the token first; a connection inside a request (its
  headers read, its response not yet sent) is never closed for another, so a client that
  sends its request as it connects gets in unless ``max_connections`` newer connections
  arrive before its headers do, however many idle ones are held.

With a token, a connection becomes its holder's once one of its requests carries the token;
anonymous connections cannot push a holder's idle connection out, only each other (a new one
is closed when no other anonymous one waits). asyncio accepts up to the listen backlog of
connections in one go before the guard sees them, so the process's open files must hold
``max_connections`` plus that backlog (``serve.main`` sees to both).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, its connection's lifetime kept by the class's ``guard`` (a
    ``ConnectionGuard`` makes the subclass that carries it)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holder = False  # a request on this connection carried the token
        self.header_timer: asyncio.TimerHandle | None = None

    def in_request(self) -> bool:
        """Whether a request's headers are in and its response is not yet sent."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.guard.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self.guard.update(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.guard.update(self)


class ConnectionGuard:
    """The open connections of one server, each waiting for its next request's headers
    under ``header_timeout`` seconds, at most ``max_connections`` of them (see the module
    docstring); ``protocol()`` is the class to give uvicorn (``http=``)."""

    def __init__(self, header_timeout: float, max_connections: int, token: str | None = None):
        self.header_timeout, self.max_connections = float(header_timeout), int(max_connections)
        self.expected = None if token is None else b"Bearer " + token.encode()
        self.open: set[GuardedH11] = set()
        # The connections between requests, the longest waiting first (dicts keep order).
        self.waiting: dict[GuardedH11, None] = {}

    def protocol(self) -> type[GuardedH11]:
        return type("GuardedH11", (GuardedH11,), {"guard": self})

    def opened(self, conn: GuardedH11) -> None:
        self.open.add(conn)
        self._wait(conn)
        if len(self.open) > self.max_connections:
            # The new connection is itself waiting and anonymous, so there is always one.
            self._close(next((c for c in self.waiting if not c.holder), conn))

    def update(self, conn: GuardedH11) -> None:
        """After ``conn`` read data or sent a response: its headers clock runs while it waits
        for a request, not while it is in one."""
        if conn not in self.open or conn.transport.is_closing():
            return
        if conn.in_request():
            if conn in self.waiting:
                del self.waiting[conn]
                conn.header_timer.cancel()
            if self.expected is not None and not conn.holder:
                given = dict(conn.headers).get(b"authorization", b"")
                conn.holder = hmac.compare_digest(given, self.expected)
        elif conn not in self.waiting:
            self._wait(conn)

    def forget(self, conn: GuardedH11) -> None:
        """``conn`` is closed (idempotent)."""
        self.open.discard(conn)
        self.waiting.pop(conn, None)
        if conn.header_timer is not None:
            conn.header_timer.cancel()

    def _wait(self, conn: GuardedH11) -> None:
        self.waiting[conn] = None
        conn.header_timer = conn.loop.call_later(self.header_timeout, self._expire, conn)

    def _expire(self, conn: GuardedH11) -> None:
        if conn in self.waiting:
            self._close(conn)

    def _close(self, conn: GuardedH11) -> None:
        self.forget(conn)
        conn.transport.close()
