"""The engine's batch (``serve --max-batch N``, docs/batching.md): up to N requests decoded
together by one decode/batch.py :class:`~mlx_dspark.decode.batch.Batch`, each on a session of
its own from a small pool.

A request joins between two steps. Its prompt is prefilled a piece at a time (the pieces
``decode`` cuts alone, decode/pieces.py), the shortest prompt left first: a short request is
not stuck behind a long prefill, and a cancelled one stops between two pieces. While rows
decode, the pieces run as a per-turn token budget accrues (``--prefill-budget``), so a long
prompt does not stall them; with none decoding, a piece's worth runs each turn. Each row's
tokens become chunks by ``text.stream.chunks``, the chunk builder ``api.stream`` runs on
decode's tokens, fed here with the
row's tokens and the stats as they stood at each, so a row's chunks are the ones its request
gets alone. The prompt cache serves every row as it serves a request alone (PromptCache's
parts: start, the checkpoints while it prefills, remember at the end of the answer); a
snapshot copies a batched row's own state out (TargetCache.snapshot)."""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import device
from ..decode import pieces
from ..decode.batch import Batch
from ..decode.session import Session
from ..stats import Stats
from ..text.stream import chunks
from .job import CANCELLED, Job, Left


class Rows:
    """The batch an :class:`~mlx_dspark.serve.engine.Engine` runs (``engine``: its pair, prompt
    cache, counters and the job handing of a request alone)."""

    def __init__(self, engine, max_batch: int, prefill_budget: float = pieces.PREFILL_BUDGET):
        self.engine, self.max_batch, self.prefill_budget = engine, max_batch, prefill_budget
        self.credit = 0.0       # prompt tokens the joining rows may prefill now
        self.batch = Batch()
        self.members: list[Job] = []
        self.free: list[Session] = []
        self.steps = 0
        self._wired = contextlib.ExitStack()

    def takes(self, job: Job) -> bool:
        """Whether ``job`` may join now: a place is free (every request decodes in the batch,
        a thinking budget's too)."""
        return len(self.members) < self.max_batch

    def join(self, job: Job):
        """``job`` joins: its session continued from the prompt cache, its prefill started."""
        engine = self.engine
        if job.cancelled.is_set():
            job.emit("error", CANCELLED)
            engine.finished()
            return
        if not self.members:
            self._wired.enter_context(device.wired_limit((engine.pair.target,
                                                          engine.pair.drafter)))
        session = self.free.pop() if self.free else engine.new_session()
        job.session, job.shown = session, Stats()
        self.members.append(job)
        try:
            if engine.cache is not None:
                engine.cache.start(session, job.request.prompt, job.boundaries, job.space)
            job.emit("started", len(session.tokens))
            job.prefill.update(done=len(session.tokens), total=len(job.request.prompt))
            stats = Stats()
            job.joining = self.batch.join(session, job.request, stats,
                                             engine.prefilling(job, job.prefill))
            job.chunks = chunks(engine.pair, job.request, job.tokens_fed(), job.shown)
        except Exception as e:          # refused (a prompt past the vocabulary...)
            engine.failed(job, e, session)
            self._leave(job, remember=False)
        self.publish()

    def advance(self):
        """One turn: the cancelled leave, the joining rows prefill what the budget allows
        (:meth:`_prefill`), and the rows decoding take one step together."""
        engine = self.engine
        with engine.pair.lock, mx.stream(device.generation_stream()):
            for job in [m for m in self.members if m.cancelled.is_set()]:
                engine.cancelled += 1
                job.emit("error", CANCELLED)
                self._leave(job, remember=job.joining is None)
            self._prefill()
            if self.batch.rows:
                try:
                    stepped = set(map(id, self.batch.step()))
                except Exception as e:  # the batched forward itself: every row's state is
                    self._fail_decoding(e)      # suspect, the engine thread lives on
                    stepped = set()
                self.steps += 1
                for job in [m for m in self.members if m.row is not None]:
                    if id(job.row) in stepped or job.row.done:
                        self._deliver(job)
                if self.steps % device.CLEAR_EVERY == 0:
                    mx.clear_cache()
        if not any(m.joining is not None for m in self.members):
            engine.prefill = None
        self.publish()

    def _prefill(self):
        """The joining rows' prefill this turn, in whole pieces (decode/pieces.py), the
        shortest prompt left first. While rows decode, the prompt tokens prefilled average
        ``prefill_budget`` per turn: the budget accrues each turn and the next piece runs
        once it is covered, so the rows decoding take about piece / budget steps between two
        pieces (docs/batching.md, "Prefill beside decoding"). With no row decoding a turn
        prefills a piece's worth (several short prompts, or one piece of a long one)."""
        if not any(m.joining is not None for m in self.members):
            self.credit = 0
            return
        self.credit = self.credit + self.prefill_budget if self.batch.rows else pieces.PIECE
        while joining := [m for m in self.members if m.joining is not None]:
            job = min(joining, key=_left)
            if _next_piece(job) > self.credit:
                return
            before = job.prefill["done"]
            self._piece(job)
            self.credit -= job.prefill["done"] - before

    def _piece(self, job: Job):
        """One piece of ``job``'s prefill; once it has its first token, its row joins."""
        try:
            next(job.joining)
            return
        except StopIteration as joined:
            job.row, job.joining = joined.value, None
        except Left:                    # cancelled between two pieces: the checkpoints stay
            self.engine.cancelled += 1
            job.emit("error", CANCELLED)
            self._leave(job, remember=False)
            return
        except Exception as e:
            self.engine.failed(job, e, job.session)
            self._leave(job, remember=False)
            return
        mx.clear_cache()                # the prefill's buffers (as decode's housekeeping)
        self._deliver(job)

    def _fail_decoding(self, e: Exception):
        """A step of the whole batch raised ``e`` (no row's own error): each decoding row
        ends with it, its session reset; the joining rows go on."""
        for job in [m for m in self.members if m.row is not None]:
            self.engine.failed(job, e, job.session)
            self._leave(job, remember=False)

    def _deliver(self, job: Job):
        """Hand out the chunks of the tokens ``job``'s row emitted in its last step; it
        leaves once it ended (its last chunk, its error) or its client left."""
        row, engine = job.row, self.engine
        if row.error is not None:
            engine.failed(job, row.error, job.session)
            self._leave(job, remember=False)
            return
        job.fed.extend(zip(row.tokens, row.seen))
        for _ in row.tokens:
            chunk = next(job.chunks)
            if not engine.hand(job, chunk, job.tokens):
                self._leave(job, remember=True)
                return
            if chunk.finish_reason is not None:
                engine.served += 1
                self._leave(job, remember=True)
                return

    def _leave(self, job: Job, remember: bool):
        """``job`` is done: out of the batch, its state remembered (the next turn of a
        chat; not after a failure), its session back in the pool."""
        for steps in (job.joining, job.chunks):
            if steps is not None:
                steps.close()
        if job.row is not None and job.row in self.batch.rows:
            self.batch.remove(job.row)
        cache, session = self.engine.cache, job.session
        if cache is not None:
            cache.finish(session)
            if remember:
                cache.remember(session, job.space)
        self.members.remove(job)
        session.reset()                 # its memory freed; the next row restores or starts
        self.free.append(session)
        if not self.members:
            self._wired.close()
        self.engine.finished()

    def close(self):
        """The engine stops: every job leaves (their handlers were told)."""
        for job in list(self.members):
            self._leave(job, remember=False)

    def publish(self):
        """What ``/health`` shows of the batch, replaced whole (read from another thread)."""
        rows = [{"route": m.route, **({"phase": "prefill", **m.prefill}
                                          if m.joining is not None or m.row is None
                                          else {"phase": "decode", "generated": m.shown.generated})}
                for m in self.members]
        self.engine.batch = {"size": len(rows), "max": self.max_batch, "rows": rows}


def _left(job: Job) -> int:
    """The prompt tokens ``job`` has still to prefill."""
    return job.prefill["total"] - job.prefill["done"]


def _next_piece(job: Job) -> int:
    """The tokens of ``job``'s next piece (at most: a checkpoint may cut it shorter)."""
    return max(1, min(pieces.size_at(job.prefill["done"]), _left(job)))
