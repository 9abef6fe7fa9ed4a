"""Rows decoded together (docs/batching.md): several sessions, each with its own request, stepped
as one batch. Each step is one target forward for every row that steps serially and one verify
pass for every row that speculates with the same number of drafts (``NemotronH.step_rows``),
and one host read for all of them.

A row is a session and its request, run by the loop's own pieces (loop.py): its prompt is
prefilled alone, its tokens chosen by its own sampler, noise, constraint and stop tokens, and a
round drafts with its own drafter, accepts its own count and commits (rolls back) its own caches
exactly, as alone. Each row keeps its own caches, so a row joins or leaves between steps without
touching the others, and every row's tokens are the tokens it gets alone wherever the batched
forward is bitwise the row's forward alone (MLX's stock CPU BLAS; docs/batching.md has where it
is not)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Iterator

import mlx.core as mx

from .. import device
from ..request import NonFiniteLogits, Request, RequestError
from ..stats import Stats
from . import budget, loop
from ..logits import constraint as constraints
from ..logits.processors import Processors
from ..policy.batch_control import BatchControl, SizeControl, cohort
from .loop import Ahead as RowAhead
from .loop import (_emit, _first, _serial, _speculate, builds_ahead, first_steps, pick,
                   round_steps, undo_ahead)
from .prefill import to_the_end
from .run import Row, StaleGenerator, check, finite
from .session import Session


@dataclass(eq=False)
class Ahead:
    """A batched serial step built before the tokens it feeds were read (the loop's step
    ahead, for rows stepping together): the rows it steps, in order, the layers they tap, their
    picks stacked (lazy) and when the step before it was read. Each row's own part (a
    loop.Ahead: its token, taps, logits and cache mark) is its session's ``ahead``, so whatever
    undoes a session's step ahead undoes the row's part (a stop token, remove, another call on
    the session); the batch undoes the others' once one is gone, or when its next step is not
    this one (a row joined, a round planned)."""

    rows: list[Row]
    taps: tuple
    picks: mx.array
    parts: list[RowAhead]
    since: float = 0.0

    def whole(self) -> bool:
        """Whether every row's part is still its session's step ahead."""
        return all(row.session.ahead is part for row, part in zip(self.rows, self.parts))

    def steps(self, rows: list[Row], n: int, taps) -> bool:
        """Whether this is the step ``rows`` take next (``n`` drafts, tapping ``taps``)."""
        return not n and taps == self.taps and rows == self.rows and self.whole()

    def undo(self):
        for row, part in zip(self.rows, self.parts):
            if row.session.ahead is part:
                undo_ahead(row.session)


class Batch:
    """Rows stepped together. :meth:`add` a session and its request (the prompt is prefilled
    and the first token chosen at once), :meth:`step` every row by one serial step or one
    round, :meth:`remove` a row whenever (a client leaving). Every row's sessions share one
    target; a row that ends leaves by itself."""

    def __init__(self):
        self.rows: list[Row] = []
        self.control = BatchControl()   # what "auto" rows stepping together decide on
        self.ahead: list[Ahead] = []      # the batched serial steps built ahead

    def add(self, session: Session, request: Request, stats: Stats | None = None) -> Row:
        row = self._start(session, request, stats)
        self._emit(row, lambda: [_first(row)])
        if not row.done:
            self.rows.append(row)
        return row

    def join(self, session: Session, request: Request, stats: Stats | None = None,
             progress=None):
        """:meth:`add` with the prompt prefilled a piece per ``next()`` (a generator; the
        request is checked at once): the caller steps the batch between pieces. It returns
        the row, joined (or ended at its first token). ``progress``: the prefill's callback
        (loop.prefill), which may raise to stop it between pieces."""
        row = self._start(session, request, stats, progress)
        return self._joined(row)

    def _joined(self, row: Row):
        try:
            token = None if row.request is None else (yield from first_steps(row))
        except (NonFiniteLogits, StaleGenerator, RequestError) as e:
            row.room, row.error = None, e
            return row
        self._emit(row, lambda: [token])
        if not row.done:
            self.rows.append(row)
        return row

    def _start(self, session: Session, request: Request, stats: Stats | None,
               progress=None) -> Row:
        """The row of ``request`` on ``session``, checked and started, not yet prefilled."""
        check(session, request)
        if self.rows and session.target is not self.rows[0].session.target:
            raise ValueError("every row of a batch decodes on one target")
        if any(r.session is session for r in self.rows):
            raise ValueError("this session already decodes a row of the batch")
        row = Row(session, constraints.of(request, session.target.config.vocab_size),
                  Processors.of(request), progress)
        undo_ahead(session)            # a suspended generator's step built ahead
        session.generation += 1
        row.generation = session.generation
        stats = stats if stats is not None else Stats()
        if not budget.applies(request):
            return row.begin(request, stats)
        row.plan = budget.Plan(request, stats, row)
        thinking = row.plan.thinking()
        if thinking is not None:
            return row.begin(thinking, Stats())
        self._close(row, None)
        return row

    def _close(self, row: Row, part: Stats | None) -> bool:
        """The thinking stretch of ``row`` (``part``: its stats; None: a budget of 0) ended
        within the reply: the closing ids written (``row.written``), then the last stretch
        started, its prompt not yet prefilled; False when the ids ended the reply."""
        plan = row.plan
        closing = plan.closing(part)
        for token in closing:
            over = plan.closed(token)
            row.written.append((token, plan.stats.snapshot()))
            if over:
                return False
            plan.advance(token)
        row.begin(plan.rest(), Stats(), forced=len(closing))
        return True

    def remove(self, row: Row):
        """Take ``row`` out (between steps): the others go on as if it had never joined."""
        self.rows.remove(row)
        undo_ahead(row.session)
        self._keep_whole()

    def step(self) -> list[Row]:
        """Advance every row by one step; returns the rows that stepped (each with the tokens
        it emitted in ``row.tokens``). Rows that ended leave the batch; so does a row whose
        session another call took over since (``StaleGenerator``), before any step touches it."""
        for row in self.rows:
            try:
                row.still_current()
            except StaleGenerator as e:
                row.room, row.error, row.tokens = None, e, []
        rows = [r for r in self.rows if not r.done]
        if len(rows) == 1 and not self.ahead:   # a batch of one: the loop's own step, by its
            row = rows[0]                       # own controller, no grouping to do
            row.pooled, row.batch = None, 1
            self._alone(row, _plan(row, set())[0])
            self.rows = [] if row.done else rows
            return rows
        ahead, self.ahead = self.ahead, []
        plans, deciding = self._plans(rows, {id(part) for a in ahead for part in a.parts})
        plans = sorted((plans[id(row)], i) for i, row in enumerate(rows))
        groups = [(key, [rows[i] for _, i in group])
                  for key, group in groupby(plans, key=lambda plan: plan[0])]
        taken = _taken(ahead, groups)
        for i, ((n, taps, tag), group) in enumerate(groups):
            if len(group) == 1:
                self._alone(group[0], n)
                continue
            if i not in taken:
                for row in group:
                    undo_ahead(row.session)     # built while it stepped alone
            # a cohort's step prices its size's costs when it ran as one forward (rows near
            # their max_tokens may draft fewer than the others, and so verify apart)
            control, members = deciding.get(tag, (None, ()))
            control = control if len(group) == len(members) else None
            if n:
                self._rounds(group, n, taps, control)
            else:
                self._serial(group, taps, control, taken.get(i))
        self.rows = [r for r in self.rows if not r.done]
        self._keep_whole()
        return rows

    def _alone(self, row: Row, n: int):
        """``row`` steps alone: the loop's own step, a round of ``n`` drafts or a serial step
        (built ahead within a serial stretch)."""
        token = row.tokens[-1]
        self._emit(row, (lambda: loop._round(row, token, n)) if n else
                   (lambda: [_serial(row, token, row.room)]), step=True)

    def _keep_whole(self):
        """Undo each batched step built ahead that lost a row's part (the row ended or left):
        the others' parts too, so that each row steps on as it would alone."""
        for a in self.ahead:
            if not a.whole():
                a.undo()
        self.ahead = [a for a in self.ahead if a.whole()]

    def _plans(self, rows: list[Row], batched: set[int]) -> tuple[dict, dict]:
        """Each row's next step as a group key (drafts, tapped layers, cohort tag), and the
        controller deciding for each tag of two or more rows "auto" decides for together
        (batch_control.py), with its rows. A row alone in its cohort decides by its own
        controller, as alone. ``batched``: the ids of the rows' parts of batched steps built
        ahead, which decide nothing (each is taken only where this plan steps its rows)."""
        cohorts: dict[tuple, list[Row]] = {}
        for row in rows:
            key = cohort(row)
            if key is not None:
                cohorts.setdefault(key, []).append(row)
        plans, deciding = {}, {}
        for tag, (key, members) in enumerate(cohorts.items(), 1):
            if len(members) < 2:
                members[0].pooled, members[0].batch = None, 1
                continue
            control = self.control.at(key, members)
            n = control.length() if control.speculate_next() else 0
            deciding[tag] = control, members
            for row in members:
                row.pooled, row.batch = control, len(members)
                plans[id(row)] = (min(n, row.room - 1), key[1], tag)
        for row in rows:
            plans.setdefault(id(row), _plan(row, batched) + (0,))
        return plans, deciding

    def _serial(self, rows: list[Row], taps, control: SizeControl | None = None,
                ahead: Ahead | None = None):
        """One forward feeds every row its last token (``ahead``: the one built at the last
        step); each chooses its next one. As loop._serial, within a serial stretch the forward
        after it is built on the picks and queued before they are read, for the rows that
        would build it alone (the others end or draft next: they leave the group), unless a
        row's constraint must read this step's token first (it stays: none is built). The
        forward's time goes to the ``control`` of a cohort stepping together."""
        last = [row.tokens[-1] for row in rows]
        if ahead is None:
            t0 = time.perf_counter()
            picks, parts = _forward(rows, mx.array(last, dtype=mx.int32), last, taps)
            mx.async_eval(picks)
        else:
            t0, picks, parts = ahead.since, ahead.picks, ahead.parts
        for row, token, part in zip(rows, last, parts):
            row.session.ahead = None
            row.session.feed([token], part.taps)
        on = [(row, part) for row, part in zip(rows, parts)
              if builds_ahead(row, row.room, row.pooled)]
        built = _build(on, taps) if len(on) >= 2 and all(
            row.constraint.lookahead for row in rows) else None
        read = picks.tolist()
        t_read = time.perf_counter()
        seconds = t_read - t0
        if built is not None:
            built.since = t_read
            self.ahead.append(built)
        for row, token, part in zip(rows, read, parts):
            self._emit(row, lambda: _serial_read(row, token, part.row, seconds), step=True)
        if control is not None:
            control.observe_serial(seconds)

    def _rounds(self, rows: list[Row], n: int, taps, control: SizeControl | None = None):
        """Every row drafts ``n`` tokens after its last one; one verify pass over all of them;
        one read of every row's verdict; each row accepts and commits its own. A cohort's
        ``control`` hears the round's time (its drafters' catch-up priced apart, as alone)."""
        if control is not None:
            _catch_up(rows, n, control)
        t0 = time.perf_counter()
        steps = [round_steps(row, row.tokens[-1], n) for row in rows]
        drafts = [next(s) for s in steps]
        blocks = mx.stack([mx.concatenate([mx.array([row.tokens[-1]], dtype=mx.int32),
                                           d.astype(mx.int32)]) for row, d in zip(rows, drafts)])
        target = rows[0].session.target
        logits, tapped = target.step_rows(blocks, [row.session.cache for row in rows], taps,
                                          verify=True)
        verdicts = [s.send((logits[i], tapped[i])) for i, s in enumerate(steps)]
        for row, s, read in zip(rows, steps, mx.stack(verdicts).tolist()):
            self._emit(row, lambda: s.send(read), step=True)
        if control is not None:
            control.rows = [row.control.alpha() for row in rows]   # after the verdicts
            control.observe_round(time.perf_counter() - t0, n, 0, 0)

    def _emit(self, row: Row, out, step: bool = False):
        """Run ``out`` (the row's step, from its read on; ``step``: a step after its first
        token, which the row's stats note as the loop's do), then hand its tokens out as the
        loop would (loop._emit: stop tokens, max_tokens, the constraint advanced), after the
        closing ids written since its last step. A row whose step raises ends with that
        error. A thinking budget's stretch that ends within the reply is followed by the
        closing ids and the last stretch's first token (its prompt's few new tokens
        prefilled), as alone."""
        row.tokens, row.seen = [], []
        _take_written(row)
        if row.request is None:
            return                      # its reply was written whole
        try:
            tokens = out()
            if step:
                row.note_mode()
            row.room = self._out(row, _emit(row, tokens))
            if row.done and row.plan is not None and row.reply.finish_reason is None:
                undo_ahead(row.session)
                going = self._close(row, row.stats)
                _take_written(row)
                if going:
                    row.progress = None    # the prefill's callback was the join's
                    row.room = self._out(row, _emit(row, [_first(row)]))
        except (NonFiniteLogits, StaleGenerator, RequestError) as e:   # RequestError: a
            row.room, row.error = None, e                # grammar past llguidance's limits
        if row.done and row.session.generation == row.generation:
            undo_ahead(row.session)     # it ended (a stop token is emitted, never fed)

    def _out(self, row: Row, emit) -> int | None:
        """The tokens of ``emit`` (loop._emit over one step) added to the row's, each with
        the stats as they stood; the room after them."""
        try:
            while True:
                token = next(emit)
                if row.plan is not None:
                    row.plan.took(token, row.stats)
                row.tokens.append(token)
                row.seen.append(row.reply.snapshot())
        except StopIteration as end:
            return end.value


def _take_written(row: Row):
    """The closing ids written since the row's last step join its tokens."""
    if not row.written:
        return
    row.tokens += [t for t, _ in row.written]
    row.seen += [s for _, s in row.written]
    row.written = []


def _taken(ahead: list[Ahead], groups: list) -> dict[int, Ahead]:
    """The batched serial steps built ahead that ``groups`` (group keys and rows) take, by the
    group's index; the others are undone (the batch changed: not the step they built)."""
    taken = {}
    for a in ahead:
        i = next((i for i, ((n, taps, _), rows) in enumerate(groups) if a.steps(rows, n, taps)),
                 None)
        if i is None:
            a.undo()
        else:
            taken[i] = a
    return taken


def _forward(rows: list[Row], tokens: mx.array, before: list, taps):
    """One batched serial step, lazy: row ``i`` fed ``tokens[i]`` (``before[i]``: the same
    token, an int or the last step's lazy pick) picks its next token. Returns the picks
    stacked and each row's part (its pick, taps, logits row and the cache mark before it)."""
    marks = [row.session.cache.mark() for row in rows]
    logits, tapped = rows[0].session.target.step_rows(
        tokens[:, None], [row.session.cache for row in rows], taps)
    parts = []
    for i, (row, token, mark) in enumerate(zip(rows, before, marks)):
        logit = logits[i, -1:]
        chosen = pick(row, logit, len(row.session.tokens) + 1, row.before(token),
                      row.constraint.allowed(logit))
        parts.append(RowAhead(chosen, None if tapped is None else tapped[i], logit, mark))
    return mx.stack([part.token for part in parts]), parts


def _build(on: list[tuple[Row, RowAhead]], taps) -> Ahead:
    """Build and queue the batched serial step that feeds each row its pick (lazy) in
    ``on`` (rows and their parts of this step), before they are read."""
    rows, tokens = [row for row, _ in on], [part.token for _, part in on]
    picks, parts = _forward(rows, mx.stack(tokens), tokens, taps)
    for row, part in zip(rows, parts):
        row.session.ahead = part
    mx.async_eval(picks)
    return Ahead(rows, taps, picks, parts)


def _plan(row: Row, batched: set[int]) -> tuple[int, tuple]:
    """What ``row`` does next by its own controller, as a group key: the drafts of its round
    (0: a serial step), and the target layers it taps. A serial step built ahead alone is
    taken, as the loop takes it (it was built on the controller's word that a serial step
    follows); a row's part of a batched one (its id in ``batched``) is not a decision."""
    alone = row.session.ahead is not None and id(row.session.ahead) not in batched
    speculate = not alone and _speculate(row, row.room)
    n = min(row.control.length(), row.room - 1) if speculate else 0
    return n, tuple(row.session.tap_layers or ()) if row.tap else ()


def _catch_up(rows: list[Row], n: int, control: SizeControl):
    """The rows' drafters take the taps of the tokens they have not seen, before a cohort's
    round is timed, as loop._catch_up does for one row (after it, the round's own finds
    none): a long catch-up is evaluated here and priced per token and batched serial step."""
    t0 = time.perf_counter()
    caught_up = [row.session.flush() for row in rows]
    if max(caught_up) > n + 1:
        mx.eval([row.session.draft_cache.arrays() for row in rows])
        control.observe_catchup(time.perf_counter() - t0, max(caught_up))


def _serial_read(row: Row, token: int, logits: mx.array, seconds: float) -> list[int]:
    """A serial step's token once read, counted as loop._serial counts it (a cohort's step:
    its time is its batch's, the row's own controller ages its evidence alone)."""
    token = finite(token, row.session)
    row.score(logits, [token])
    row.stats.t_serial += seconds
    row.stats.serial_steps += 1
    if row.pooled is None:
        row.control.observe_serial(seconds)
    else:
        row.control.observe_token()
    return [token]


def decode(session: Session, request: Request, stats: Stats | None = None,
           progress=None) -> Iterator[int]:
    """The tokens of ``request`` on ``session``: up to ``max_tokens``; a stop token is
    yielded and ends the run. ``stats`` (optional) is filled in as the run goes; its
    ``finish_reason`` is set just before the last token is yielded. ``progress``: the
    prefill's callback (prefill.prefill). A request the session cannot serve is refused
    here, before any token is asked for. It is decoded as a batch of one: this module is the
    one driver, and a row alone takes the loop's own steps (loop._serial, loop._round)."""
    return device.housekept(decode_one(session, request, stats, progress),
                            (session.target, session.drafter))


def decode_one(session: Session, request: Request, stats: Stats | None = None,
               progress=None) -> Iterator[int]:
    """``request`` on ``session`` as a batch of one (:func:`decode` without the device's
    housekeeping): checked and started at once, prefilled at the first ``next()``, then its
    tokens one at a time, ``stats`` standing as they did when each came; a row that fails
    raises its error after the tokens before it, and a generator resumed after another call
    took its session raises StaleGenerator."""
    batch = Batch()
    return _one(batch, batch.join(session, request, Stats(), progress),
                stats if stats is not None else Stats())


def _one(batch: Batch, joining, shown: Stats) -> Iterator[int]:
    row = to_the_end(joining)
    try:
        while True:
            for i, (token, seen) in enumerate(zip(row.tokens, row.seen)):
                vars(shown).update(vars(seen))
                yield token
                if not (row.done and i == len(row.tokens) - 1):
                    row.still_current()    # the loop's check after each token
            if row.error is not None:
                raise row.error
            if row.done:
                return
            batch.step()
    finally:
        if row in batch.rows:           # closed early (a stop string): out, as if never in
            batch.rows.remove(row)
            if row.session.generation == row.generation:
                undo_ahead(row.session)


def decode_batch(sessions: list[Session], requests: list[Request],
                 stats: list[Stats] | None = None) -> list[list[int]]:
    """Every request on its session, decoded together until each ends: the tokens of each,
    as ``decode`` yields them alone. A row that fails raises its error once all have ended."""
    batch, out = Batch(), []
    for i, (session, request) in enumerate(zip(sessions, requests)):
        out.append(batch.add(session, request, None if stats is None else stats[i]))
    tokens = {id(row): list(row.tokens) for row in out}
    while batch.rows:
        for row in batch.step():
            tokens[id(row)] += row.tokens
    failed = next((row.error for row in out if row.error is not None), None)
    if failed is not None:
        raise failed
    return [tokens[id(row)] for row in out]
