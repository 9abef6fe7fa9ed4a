"""The connections of ``mlx-dspark serve``: how long a client may take to send a request, how
long an idle connection is kept, and how many may be open (docs/serve.md, "Connections").

uvicorn's h11 protocol has an idle (keep-alive) timeout but no limit on the time to send a
request: a client that trickles a header byte by byte holds its connection, and about 2,000
of them exhausted the file descriptors. Here a connection has ``read_timeout`` seconds to send
a whole request, and when ``max_connections`` are open a new one makes room by closing the
connection that has been sending its request the longest: a client that sends its request at
once is answered however many slow ones are open."""

from __future__ import annotations

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
