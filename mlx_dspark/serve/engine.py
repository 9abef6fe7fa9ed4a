"""The engine of ``mlx-dspark serve``: one thread that owns the pair and its sessions and runs
the generations, first come first served.

It runs one scheduler over one batch (batching.py): up to ``max_batch`` requests decode
together, each on a session of its own, its prompt prefilled in pieces beside the others'
steps; every request joins, a thinking budget's too (``max_batch`` 1: a batch of at most one
row, one generation at a time). Each generation is exactly what ``generate()`` (itself a batch
of one) gives it alone. Every MLX call happens on this thread, loading
included, so no lazy array crosses threads. The engine keeps session snapshots in a
:class:`PromptCache` (in memory, and on disk with ``--prompt-cache-dir``): taken at message
ends and every few thousand tokens while prefilling and at the end of each prompt and answer,
so a request that resends a conversation, or the same system prompt before another one,
prefills only what is new."""

from __future__ import annotations

import collections
import logging
import threading

from .. import device
from ..decode.pieces import PREFILL_BUDGET
from ..decode.session import Session
from ..prompt_cache.cache import PromptCache
from ..request import NonFiniteLogits, RequestError
from ..stats import format_progress
from . import logprobs
from .batching import Rows
from .errors import ApiError
from .job import CANCELLED, Job, Left

__all__ = ["CANCELLED", "Engine", "Job"]

log = logging.getLogger("mlx_dspark.serve")
LOG_AFTER = 1.0     # a prefill that has taken this many seconds logs a line per piece


class Engine:
    """The thread that owns the pair and serves jobs in arrival order.

    ``load()`` runs on the thread and returns the pair; ``max_queue`` jobs may wait while one
    runs (more are refused); ``cache_bytes`` bounds the snapshots kept in memory (0 and no
    ``store``: no reuse, every request is prefilled from scratch); ``store(pair, session)``,
    called on the thread once the pair is loaded, returns the on-disk store
    (prompt_cache.disk.PromptStore) or None; ``use_drafter`` False (a server that never
    speculates) keeps the drafter out of the session, so no taps are collected;
    ``max_batch`` requests decode together (batching.py; 1: one at a time), and
    ``max_queue`` more may wait; ``prefill_budget``: the prompt tokens a joining request
    prefills per turn, on average, while others decode (batching.Rows)."""

    def __init__(self, load, max_queue: int, cache_bytes: int, use_drafter: bool = True,
                 store=None, max_batch: int = 1, prefill_budget: float = PREFILL_BUDGET):
        self.load, self.max_queue, self.use_drafter = load, max_queue, use_drafter
        self.max_batch, self.prefill_budget = max_batch, prefill_budget
        self.rows: Rows | None = None       # the batch, once the pair is loaded
        self._cache_bytes, self._store = cache_bytes, store
        self.cache: PromptCache | None = None
        self.pair = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._active = 0            # jobs submitted and not finished (waiting or running)
        self._stopping = False
        self._lock = threading.Condition()      # over the three above; notified on a new job
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        # the running request's prefill, as /health shows it: {"done", "total", "seconds"}
        self.prefill: dict | None = None
        # the batch, as /health shows it: {"size", "max", "rows": [each row's phase]}
        self.batch: dict = {"size": 0, "max": max_batch, "rows": []}
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
            jobs = [*self._waiting,
                    *(list(self.rows.members) if self.rows else [])]
            self._active -= len(self._waiting)
            self._waiting.clear()
        for job in jobs:
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
            if self._active >= self.max_queue + self.max_batch:
                running = "one generation is" if self.max_batch == 1 else \
                    f"{self.max_batch} generations are"
                raise ApiError(f"the server is busy: {running} running and "
                                   f"{self.max_queue} requests are waiting (--max-queue); "
                                   f"retry later", status=503, type="server_error",
                                   code="server_busy")
            self._active += 1
            self._waiting.append(job)
            self._lock.notify()

    def new_session(self) -> Session:
        return Session(self.pair.target, self.pair.drafter if self.use_drafter else None,
                       home=self.pair)

    def _main(self):
        try:
            self._serve()
        finally:
            device.release_streams()     # this thread made them: MLX's rule, see there

    def _serve(self):
        try:
            self.pair = self.load()
            store = self._store(self.pair, self.new_session()) if self._store else None
            if self._cache_bytes > 0 or store is not None:
                self.cache = PromptCache(self._cache_bytes, store)
            self.rows = Rows(self, self.max_batch, self.prefill_budget)
        except BaseException as e:        # reported by start() on the main thread
            self._load_error = e
            return
        finally:
            self._ready.set()
        while (job := self._next()) is not False:
            if job is not None:
                self.rows.join(job)
            else:
                self.rows.advance()
        self.rows.close()

    def failed(self, job: Job, e: Exception, session: Session):
        """``job``'s generation on ``session`` raised ``e``: the client hears why."""
        if isinstance(e, NonFiniteLogits):    # the session reset itself; the reason is news
            job.emit("error", f"generation failed: {e}")
        elif isinstance(e, RequestError):     # a grammar past one of llguidance's limits
            session.reset()                   # mid-answer: the request's fault, said whole
            job.emit("error", ApiError(str(e), e.param))
        else:
            log.error("generation failed", exc_info=e)
            session.reset()                   # the state may be half-updated
            job.emit("error", f"generation failed: {type(e).__name__}")

    def finished(self):
        """A job is over (served, failed or cancelled): its place is free."""
        with self._lock:
            self._active -= 1

    def _next(self) -> Job | None | bool:
        """What the thread does next, once there is something: a job to join the batch (the
        queue's head, once a place is free), None for the batch's next turn, False once
        stopping. The queue is served in order."""
        with self._lock:
            while not self._stopping:
                if self._waiting and self.rows.takes(self._waiting[0]):
                    return self._waiting.popleft()
                if self.rows.members:
                    return None
                self._lock.wait()
            return False

    def hand(self, job: Job, chunk, tokens: list[int]) -> bool:
        """Hand ``chunk`` (``tokens``: the reply's so far, this one added) to ``job``'s
        handler, its log-probabilities with the last one; False when its client has left
        (the generation stops here)."""
        tokens += [] if chunk.stop else [chunk.token]
        if chunk.finish_reason is not None and job.request.logprobs is not None:
            job.emit("logprobs", logprobs.of_reply(tokens, chunk.stats))
        if chunk.stats.finish_detail == "context":     # logged before the client hears it
            log.warning("a reply ended at the model's context limit (%s tokens: %d of "
                        "prompt, %d generated)", self.pair.target.context_limit,
                        chunk.stats.prompt_tokens, chunk.stats.generated)
        job.emit("chunk", chunk)
        if job.cancelled.is_set() and chunk.finish_reason is None:
            self.cancelled += 1
            job.emit("error", CANCELLED)   # ends a handler still waiting for it
            return False
        return True

    def prefilling(self, job: Job, where: dict | None = None):
        """The progress callback of ``job``'s prefill, called between its pieces (about 512
        tokens, decode/pieces.py): ``/health`` shows how far it is (and ``where``, a batch
        row's, is kept up to date), the log has a line per piece once it has taken a second,
        and a cancelled job (its client left, the server stops) stops there, so the engine is
        free within one piece. A retry continues from the last checkpoint snapshotted
        (message ends, every CHECKPOINT_EVERY tokens), where it computes what the cold run
        computes; a snapshot between two pieces would not."""
        reused = [0]

        def progress(done: int, total: int, seconds: float):
            if seconds == 0.0:          # the start: the tokens already held
                reused[0] = done
            self.prefill = {"done": done, "total": total, "seconds": round(seconds, 3)}
            if where is not None:
                where.update(done=done, total=total)
            if seconds >= LOG_AFTER:
                log.info(format_progress(done, total, reused[0], seconds))
            if job.cancelled.is_set():
                raise Left
        return progress
