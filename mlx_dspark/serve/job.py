"""One request on its way through the serve engine (engine.py, batching.py): the job and how
its handler hears of it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from ..request import Request

CANCELLED = "the request was cancelled (its client went away)"


@dataclass(eq=False)          # a job is itself: the queue finds it by identity
class Job:
    """One request on its way through the engine; on ``out`` come ``("started", reused
    prompt tokens)`` when it leaves the queue, then its chunks (or an error)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    boundaries: tuple = ()      # where the prompt's chat messages end (checkpoints)
    space: str = ""             # whose snapshots it may use (API key and cache_salt, hashed)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, item):
        """Hand ``(kind, item)`` to the handler; an "error" is the reason a generation failed
        (a str) or a refusal of the request (an ApiError)."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, item))
        except RuntimeError:        # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()


class Left(Exception):
    """The job was cancelled (its client left, or the server stops) during its prefill."""
