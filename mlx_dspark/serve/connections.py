"""The connections of ``mlx-dspark serve``: how long a client may take to send a request, how
long an idle connection is kept, and how many may be open (docs/serve.md, "Connections").

uvicorn's h11 protocol has an idle (keep-alive) timeout but no limit on the time to send a
request: a client that trickles a header byte by byte holds its connection, and about 2,000
of them exhausted the file descriptors. Here a connection has ``read_timeout`` seconds to send
a whole request, and when ``max_connections`` are open a new one makes room by closing the
connection that has been sending its request the longest: a client that sends its request at
once is answered however many slow ones are open.

When ``accept()`` still finds no descriptor left, asyncio stops accepting for a second and
reports it with a traceback; :func:`out_of_files_handler` makes that one warning line and
closes the slowest senders, so the retry finds room."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class Limits:
    read_timeout: float = 30.0      # seconds to send a whole request (headers and body)
    idle_timeout: int = 5           # seconds a kept-alive connection waits for a next request
    max_connections: int = 1000


def protocol(limits: Limits) -> type:
    """An h11 protocol class (``uvicorn.Config(http=...)``) enforcing ``limits``; uvicorn's
    ``limit_concurrency`` answers 503 when no connection could be closed to make room."""
    reading: dict = {}      # connections still sending their request, oldest first -> timer

    class Guarded(H11Protocol):
        @staticmethod
        def make_room(n: int) -> int:
            """Close up to ``n`` of the connections that have been sending their request the
            longest; returns how many were closed."""
            oldest = list(reading)[:n]
            for c in oldest:
                c._drop()
            return len(oldest)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > limits.max_connections:
                oldest = next((c for c in reading if c is not self), None)
                if oldest is not None:
                    oldest._drop()

        def data_received(self, data: bytes):
            super().data_received(data)
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) \
                    and not self.transport.is_closing():
                self._arm()             # a request under way
            else:
                self._disarm()          # received whole (or the connection is ending)

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            if self not in reading:
                reading[self] = self.loop.call_later(limits.read_timeout, self._drop)

        def _disarm(self):
            timer = reading.pop(self, None)
            if timer is not None:
                timer.cancel()

        def _drop(self):
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded


OUT_OF_FILES = "socket.accept() out of system resource"
log = logging.getLogger("mlx_dspark.serve")


def out_of_files_handler(guarded: type, room: int, quiet_s: float = 10.0):
    """An asyncio exception handler (``loop.set_exception_handler``) for a server whose
    protocol is ``guarded``: asyncio has already paused accepting when it calls this for an
    exhausted descriptor table; close ``room`` slow senders and say so once per ``quiet_s``.
    Anything else goes to asyncio's default handler."""
    said = [float("-inf")]

    def handler(loop, context):
        if context.get("message") != OUT_OF_FILES:
            loop.default_exception_handler(context)
            return
        closed = guarded.make_room(room)
        if time.monotonic() - said[0] >= quiet_s:
            said[0] = time.monotonic()
            log.warning("out of file descriptors (%s): accepting paused for a second, %d slow "
                        "connections closed", context.get("exception"), closed)

    return handler
