"""One request on its way through the serve engine (engine.py, batching.py): the job, its
place in the batch and how its handler hears of it.

A job's events wait in its queue until its handler takes them, and a handler streaming to a
client waits for the client to read. A client that reads more slowly than the engine writes
would have its answer buffered whole, so a queue holds at most ``UNREAD`` events: the event
that would go past them ends the request instead, with a ``slow_reader`` error that follows
the events already queued. The engine stops its generation at that token, as for a client
that left (what was prefilled and generated stays in the prompt cache, for a retry), and the
other rows of a batch decode on; a stalled client takes no engine time."""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field

from ..request import Request
from ..stats import Stats
from .errors import ApiError

CANCELLED = "the request was cancelled (its client went away)"
UNREAD = 4096       # events a job's handler may leave unread (one per token)


def slow_reader(unread: int) -> ApiError:
    """What the client of a job that ran past ``UNREAD`` hears last."""
    return ApiError(f"the client read its stream too slowly: {unread} events were waiting "
                    f"unread, so the request was stopped (read as the stream comes, or ask "
                    f"without stream)", code="slow_reader", status=429,
                    type="rate_limit_error")


@dataclass(eq=False)          # a job is itself: the queue finds it by identity
class Job:
    """One request on its way through the engine, from the queue through the batch; on
    ``out`` come ``("started", reused prompt tokens)`` when it leaves the queue, then its
    chunks (or an error), at most ``UNREAD`` of them waiting (:meth:`take` takes one)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    boundaries: tuple = ()      # where the prompt's chat messages end (checkpoints)
    space: str = ""             # whose snapshots it may use (API key and cache_salt, hashed)
    route: str = ""             # the path it came on, as /health shows each row
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    unread: int = 0             # events emitted and not yet taken
    overflowed: bool = False    # the slow_reader error is queued: nothing more is
    _count: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # in the batch (serve/batching.Rows): its pooled session, the stats its chunks show, the
    # tokens waiting to become chunks (each with the stats as it came), its chunks, its
    # prefill while it joins (a generator; None once it decodes) and how far it is, its row
    # of the batch once joined, and the tokens generated so far (the logprobs')
    session: object = None
    shown: Stats | None = None
    chunks: object = None
    joining: object = None
    prefill: dict = field(default_factory=lambda: {"done": 0, "total": 0})
    row: object = None
    fed: collections.deque = field(default_factory=collections.deque)
    tokens: list[int] = field(default_factory=list)

    def emit(self, kind: str, item):
        """Hand ``(kind, item)`` to the handler; an "error" is the reason a generation failed
        (a str) or a refusal of the request (an ApiError). Past ``UNREAD`` unread events, the
        slow_reader error goes instead and the job is cancelled."""
        with self._count:
            if self.overflowed:
                return
            if self.unread >= UNREAD:
                self.overflowed = True
                kind, item = "error", slow_reader(self.unread)
                self.cancelled.set()        # the engine stops the generation at this token
            self.unread += 1
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, item))
        except RuntimeError:        # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()

    def tokens_fed(self):
        """The token source of its chunks: each token, the shown stats set to what they were
        as it came. The engine hands out one chunk per token fed (text.stream.chunks makes one
        per token), so the source never runs dry before the row has ended."""
        while self.fed:
            token, seen = self.fed.popleft()
            vars(self.shown).update(vars(seen))
            yield token

    async def take(self, timeout: float | None = None):
        """The next event, waited for up to ``timeout`` seconds (asyncio.TimeoutError)."""
        event = await asyncio.wait_for(self.out.get(), timeout)
        with self._count:
            self.unread -= 1
        return event


class Left(Exception):
    """The job was cancelled (its client left, or the server stops) during its prefill."""
