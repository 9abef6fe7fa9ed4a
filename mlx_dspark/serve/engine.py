"""The engine of ``mlx-dspark serve``: one thread that owns the pair and its session and runs
one generation at a time, first come first served.

A pair's session holds one target cache and one drafter cache, and MLX runs one stream of
work; serving requests in turn keeps each generation exactly what ``generate()`` gives
(batching several sequences into one forward is a later step). Every MLX call happens on this
thread, loading included, so no lazy array crosses threads. The engine keeps session
snapshots in a :class:`PromptCache` (in memory, and on disk with ``--prompt-cache-dir``):
taken at message ends and every few thousand tokens while prefilling and at the end of each
prompt and answer, so a request that resends a conversation, or the same system prompt
before another one, prefills only what is new."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field

from .. import api
from ..decode.session import Session
from ..prompt_cache.cache import PromptCache
from ..request import NonFiniteLogits, Request, RequestError
from ..stats import format_progress
from . import logprobs
from .errors import ApiError

log = logging.getLogger("mlx_dspark.serve")
CANCELLED = "the request was cancelled (its client went away)"
LOG_AFTER = 1.0     # a prefill that has taken this many seconds logs a line per piece


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


class Engine:
    """The thread that owns the pair and serves jobs one at a time, in arrival order.

    ``load()`` runs on the thread and returns the pair; ``max_queue`` jobs may wait while one
    runs (more are refused); ``cache_bytes`` bounds the snapshots kept in memory (0 and no
    ``store``: no reuse, every request is prefilled from scratch); ``store(pair, session)``,
    called on the thread once the pair is loaded, returns the on-disk store
    (prompt_cache.disk.PromptStore) or None; ``use_drafter`` False (a server that never
    speculates) keeps the drafter out of the session, so no taps are collected."""

    def __init__(self, load, max_queue: int, cache_bytes: int, use_drafter: bool = True,
                 store=None):
        self.load, self.max_queue, self.use_drafter = load, max_queue, use_drafter
        self._cache_bytes, self._store = cache_bytes, store
        self.cache: PromptCache | None = None
        self.pair = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._active = 0            # jobs submitted and not finished (waiting or running)
        self._stopping = False
        self._lock = threading.Condition()      # over the three above; notified on a new job
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._current: Job | None = None
        # the running request's prefill, as /health shows it: {"done", "total", "seconds"}
        self.prefill: dict | None = None
        self.served = self.cancelled = 0    # generations finished, and stopped early
        self._thread = threading.Thread(target=self._main, name="mlx-dspark-engine",
                                        daemon=True)

    def start(self):
        """Start the thread and wait for the pair; a load error is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def cancel_all(self, reason: str):
        """End every request with an error event: the waiting ones never start, the running
        one stops at its next token (or its prefill's next piece)."""
        with self._lock:
            jobs = [self._current, *self._waiting]
            self._active -= len(self._waiting)
            self._waiting.clear()
        for job in jobs:
            if job is not None:
                job.cancelled.set()
                job.emit("error", reason)

    def stop(self):
        """Cancel what is left and end the thread (the generation in flight stops at its next
        token, or its prefill's next piece)."""
        if self._thread.is_alive():
            self.cancel_all("the server is shutting down")
            with self._lock:
                self._stopping = True
                self._lock.notify()
            self._thread.join()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def position(self, job: Job) -> int | None:
        """Where ``job`` waits: 1 runs next; None once it runs (or has left)."""
        with self._lock:
            return self._waiting.index(job) + 1 if job in self._waiting else None

    def cancel(self, job: Job):
        """``job``'s client is gone: if it waits, it leaves the queue now, so that its place
        is free for the next request at once; if it runs, it stops at its next token (or
        its prefill's next piece)."""
        job.cancelled.set()
        with self._lock:
            if job not in self._waiting:
                return
            self._waiting.remove(job)
            self._active -= 1
        job.emit("error", CANCELLED)          # ends a handler still waiting for it

    def submit(self, job: Job):
        with self._lock:
            if self._active > self.max_queue:
                raise ApiError(f"the server is busy: one generation is running and "
                                   f"{self.max_queue} requests are waiting (--max-queue); "
                                   f"retry later", status=503, type="server_error",
                                   code="server_busy")
            self._active += 1
            self._waiting.append(job)
            self._lock.notify()

    def _main(self):
        try:
            self.pair = self.load()
            self.session = Session(self.pair.target,
                                   self.pair.drafter if self.use_drafter else None,
                                   home=self.pair)
            store = self._store(self.pair, self.session) if self._store else None
            if self._cache_bytes > 0 or store is not None:
                self.cache = PromptCache(self._cache_bytes, store)
        except BaseException as e:        # reported by start() on the main thread
            self._load_error = e
            return
        finally:
            self._ready.set()
        while (job := self._next()) is not None:
            try:
                if job.cancelled.is_set():
                    job.emit("error", CANCELLED)
                else:
                    self._run(job)
            except NonFiniteLogits as e:      # the session reset itself; the reason is news
                job.emit("error", f"generation failed: {e}")
            except RequestError as e:         # a grammar past one of llguidance's limits
                self.session.reset()          # mid-answer: the request's fault, said whole
                job.emit("error", ApiError(str(e), e.param))
            except Exception as e:
                log.exception("generation failed")
                self.session.reset()          # the state may be half-updated
                job.emit("error", f"generation failed: {type(e).__name__}")
            finally:
                self._current = self.prefill = None
                with self._lock:
                    self._active -= 1

    def _next(self) -> Job | None:
        """The next job (now the current one), once there is one; None once stopping."""
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            self._current = self._waiting.popleft()
            return self._current

    def _run(self, job: Job):
        session, cache = self.session, self.cache
        if cache is not None:
            stream = cache.through(session, lambda s: self._generation(job, s),
                                   job.request.prompt, job.boundaries, job.space)
        else:
            session.reset()
            stream = self._generation(job, session)
        tokens = []
        try:
            for chunk in stream:
                tokens += [] if chunk.stop else [chunk.token]
                if chunk.finish_reason is not None and job.request.logprobs is not None:
                    job.emit("logprobs", logprobs.of_reply(self.pair.target, job.request,
                                                           tokens, chunk.stats.logprobs))
                job.emit("chunk", chunk)
                if chunk.stats.finish_detail == "context":
                    log.warning("a reply ended at the model's context limit (%s tokens: %d of "
                             "prompt, %d generated)", self.pair.target.context_limit,
                             chunk.stats.prompt_tokens, chunk.stats.generated)
                if job.cancelled.is_set() and chunk.finish_reason is None:
                    self.cancelled += 1
                    job.emit("error", CANCELLED)   # ends a handler still waiting for it
                    break
            else:
                self.served += 1
        except _Left:                         # between two prefill pieces; those up to the
            self.cancelled += 1               # last checkpoint stay, for a retry
            job.emit("error", CANCELLED)
        finally:
            stream.close()      # the prompt cache remembers prompt and answer: the next turn

    def _generation(self, job: Job, session: Session):
        """The job's generation on ``session``, its prefix restored: the client hears how
        much was (``"started"``), and its prefill reports to :meth:`_prefilling`."""
        job.emit("started", len(session.tokens))
        if self.cache is None:
            session.on_checkpoint = None
        return api.stream(self.pair, job.request, session,
                          progress=self._prefilling(job))

    def _prefilling(self, job: Job):
        """The progress callback of ``job``'s prefill, called between its pieces (about 512
        tokens, decode/pieces.py): ``/health`` shows how far it is, the log has a line per
        piece once it has taken a second, and a cancelled job (its client left, the server
        stops) stops there, so the engine is free within one piece. A retry continues from
        the last checkpoint snapshotted (message ends, every CHECKPOINT_EVERY tokens), where
        it computes what the cold run computes; a snapshot between two pieces would not."""
        reused = [0]

        def progress(done: int, total: int, seconds: float):
            if seconds == 0.0:          # the start: the tokens already held
                reused[0] = done
            self.prefill = {"done": done, "total": total, "seconds": round(seconds, 3)}
            if seconds >= LOG_AFTER:
                log.info(format_progress(done, total, reused[0], seconds))
            if job.cancelled.is_set():
                raise _Left
        return progress


class _Left(Exception):
    """The job was cancelled (its client left, or the server stops) during its prefill."""
