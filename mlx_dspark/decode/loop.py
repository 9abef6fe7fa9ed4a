"""The speculative decoding loop (docs/design.md §7), one short function per step.

    prefill  -> the prompt through the target (taps queued for the drafter), first token
    per round:
      catch up the drafter gets the taps of tokens it has not seen (prompt, serial steps)
      draft    d1..dN = drafter.propose(bonus, N, draw)       (+ the draft distributions)
      verify   target over [bonus, d1..dN] in one pass        -> p_0..p_N, taps
      accept   coupled match (same Gumbel noise) / rejection  -> a accepted, next token
      commit   target keeps bonus, d1..da (exact rollback); their taps go to the drafter

A serial step is the same machinery with no drafts. The break-even controller decides, before
each step, which of the two to run, and N (``num_draft="auto"``: length.py). Every row of
logits, the drafter's and the target's, goes through the call's logits processors with the
tokens before it (processors.py: penalties), then is masked by the call's constraint
(constraint.py: a grammar, or the null form) before warping: each draft is drawn under the mask
of the tokens before it, the verify pass's row i takes the mask after d1..di, and the
constraint rolls back the drafts the target rejected.
``decode(session, request)`` yields tokens one at a time; the session holds every cache, the
request every option. Stop tokens and ``max_tokens`` are applied here so that the target and
drafter state after a stop is the same as after serial decoding (the stop token is emitted,
never fed). ``decode`` runs these steps as a batch of one (batch.py, the one driver: a thinking
budget's stretches follow one another within a row, budget.py); the device's housekeeping
wraps it (device.housekept)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..logits import sampling
from ..logits.draw import Draw
from ..logits.sampling import constrain
from .prefill import prefill, prefill_steps, reuse, to_the_end  # noqa: F401 (prefill: public)
from .run import Row, StaleGenerator, finite  # noqa: F401 (StaleGenerator: public)
from .session import Session


# ---------------------------------------------------------------------------------------------
# The steps


def pick(row: Row, logits: mx.array, position: int, before, allowed=None) -> mx.array:
    """Choose the token at ``position`` from one row of target logits (lazy, shape []), after
    the tokens ``before`` (the processors'), among the ``allowed`` ones under a grammar; -1
    when the logits are not finite, a lower code when a request's field left them unusable
    (see :func:`finite`)."""
    z, code = row.processors.checked(before, logits) if row.processors else (logits, None)
    token = sampling.choose(row.sampler, constrain(z, allowed),
                            row.noise.at(position, 1, logits.shape[-1]))[0].astype(mx.int32)
    if code is not None:        # (without processors no row is theirs to spoil: no code to read)
        token = mx.where(code[0] == 0, token, code[0])
    return mx.where(mx.isfinite(logits).all(), token, -1)


def serial_step(row: Row, token):
    """Feed one token (an int, or the previous step's lazy token), choose the next. Returns
    the lazy next token, the taps and the row it was chosen from; the caller feeds the token
    once it has read it."""
    session = row.session
    logits, taps = session.target.step(mx.array(token, dtype=mx.int32).reshape(1, 1),
                                       session.cache,
                                       tap_layers=session.tap_layers if row.tap else None)
    z = logits[0, -1:]
    return pick(row, z, len(session.tokens) + 1, row.before(token),
                row.constraint.allowed(z)), taps, z


def draft(row: Row, bonus: int, n: int, noise: mx.array | None):
    """The drafter proposes d1..dn after the bonus with ``noise`` [n, V], drawn as the target
    draws (one :class:`Draw`: the sampling, a grammar's masks, the processors with the
    history); lazy tokens and logits."""
    draw = Draw(row.sampler, noise, row.constraint.drafting, row.processors, row.before(bonus))
    return row.session.drafter.propose(bonus, n, draw, cache=row.session.draft_cache)


def verify(session: Session, bonus: int, drafts: mx.array):
    """One target pass over [bonus, d1..dn] (drafts still lazy): logits [n+1, V] and taps."""
    tokens = mx.concatenate([mx.array([bonus], dtype=mx.int32), drafts.astype(mx.int32)])
    logits, taps = session.target.verify(tokens[None], session.cache,
                                         tap_layers=session.tap_layers)
    return logits[0], taps


def accept(drafts: mx.array, draft_logits: mx.array, target_logits: mx.array,
           sampler: sampling.Sampler, noise: mx.array | None, key,
           allowed: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """How many drafts survive, and the token after them (docs/design.md §7 step 3), both lazy.

    ``noise`` is the noise the drafts were drawn with (rows 1..n) plus the row after them:
    the coupled scheme compares each draft with the target's Gumbel-max token under the same
    noise; rejection sampling compares the two warped distributions. ``allowed``: a grammar's
    masks of the target's rows (the drafter's are masked already)."""
    target_logits = constrain(target_logits, allowed)
    if sampler.coupled:
        return sampling.accept_coupled(drafts, sampling.choose(sampler, target_logits, noise))
    return sampling.accept_rejection(drafts, sampling.warped(sampler, target_logits),
                                     sampling.warped(sampler, draft_logits), key)


def commit(session: Session, bonus: int, drafts: list[int], taps: mx.array, keep: int):
    """Keep the first ``keep`` verified tokens (bonus, d1..d_{keep-1}); drop the rest."""
    session.target.commit(session.cache, keep)
    mx.async_eval(session.cache.arrays())     # the rollback runs while Python goes on
    session.feed([bonus] + drafts[:keep - 1], taps[:keep])


# ---------------------------------------------------------------------------------------------
# The step ahead: serial steps are pipelined (as mlx-lm's generate_step), the next one built
# on the lazy token and queued before this one is read.


@dataclass
class Ahead:
    """A serial step built before the token it feeds was read: its lazy token and taps, the
    cache mark that undoes it, and when the step before it was read (its time starts there).
    It lives on the session (``session.ahead``) alone: a decode that finds one left by a
    suspended generator undoes it, as do a stop token read and a stream closed early."""

    token: mx.array
    taps: mx.array | None
    row: mx.array
    mark: object
    since: float = 0.0


def build_ahead(row: Row, token: mx.array):
    """Build and queue the serial step that feeds ``token`` (lazy), before it is read."""
    mark = row.session.cache.mark()
    row.session.ahead = Ahead(*serial_step(row, token), mark)
    mx.async_eval(row.session.ahead.token)


def undo_ahead(session: Session):
    """Forget the step built ahead, if there is one (a stop token is emitted, never fed)."""
    if session.ahead is not None:
        session.cache.rewind(session.ahead.mark)
        session.ahead = None


# ---------------------------------------------------------------------------------------------
# The loop


def _first(row: Row) -> int:
    """Prefill the prompt and choose the first token (the first bonus)."""
    return to_the_end(first_steps(row))


def first_steps(row: Row):
    """:func:`_first` in steps (a generator): it yields after each piece of the prefill but
    the last (prefill.prefill_steps), and returns the first token."""
    session, stats, prompt = row.session, row.stats, list(row.request.prompt)
    t0 = time.perf_counter()
    forced = row.forced if row.scores is not None else 0
    stats.reused_tokens = reuse(session, prompt, forced)
    stats.generated = 0
    rows = yield from prefill_steps(session, prompt, tap=row.tap, progress=row.progress,
                                    scored=forced)
    last = rows[-1:] if forced else rows[None]
    token = pick(row, last, len(prompt), row.before(), row.constraint.allowed(last))
    token = finite(token.item(), session)
    stats.t_prefill = time.perf_counter() - t0
    if forced:
        row.score(rows[:-1], prompt[-forced:])
    row.score(last, [token])
    return token


def _emit(row: Row, out: list[int]):
    """Yield the tokens of one step; return the tokens still allowed after them, or None
    when the last one ends the row. Only the last token can end it (a round stops at its
    first stop token); its finish reason is set before it is yielded, so a consumer can mark
    the last token's chunk as the final one."""
    session, stats = row.session, row.stats
    for token in out[:-1]:
        stats.generated += 1
        yield token
        row.still_current()
    token = out[-1]
    stats.generated += 1
    room = asked = row.request.max_tokens - stats.generated
    if session.target.context_limit is not None:
        room = min(room, session.target.context_limit - len(session.tokens) - 1)
    if token in row.request.stop_tokens:
        stats.finish_reason = "stop"
    elif room <= 0:
        stats.finish_reason, stats.finish_detail = "length", \
            "max_tokens" if asked <= 0 else "context"
    if stats.finish_reason is not None and row.scores is not None:
        stats.logprobs = row.scored()
    yield token
    if stats.finish_reason is not None:
        return None
    row.constraint.advance(token)
    row.still_current()
    return room


def _speculate(row: Row, room: int, control=None) -> bool:
    """Whether the next step (with ``room`` tokens left to generate) is a speculative round,
    by ``control`` (the controller deciding for the run: its own unless a batch's)."""
    control = row.control if control is None else control
    return row.use_drafter and room >= 2 and control.speculate_next()


def builds_ahead(row: Row, room: int, control=None) -> bool:
    """Whether a serial step with ``room`` tokens left builds the step after it ahead: that
    one is a serial step too (by ``control``, as :func:`_speculate`), within a serial stretch
    (while speculating, a serial step is a single cost refresh), and the constraint masks it
    without this step's token read."""
    control = row.control if control is None else control
    return room >= 2 and row.constraint.lookahead \
        and not (row.use_drafter and control.speculating) \
        and not _speculate(row, room - 1, control)


def _serial(row: Row, token: int, room: int) -> int:
    """Feed ``token`` and read the one after it. Within a serial stretch the step after this
    one is built and queued before this one's token is read (the step ahead); while
    speculating, a serial step is a single cost refresh, decided after it is observed."""
    session = row.session
    ahead, session.ahead = session.ahead, None
    if ahead is None:
        t0 = time.perf_counter()
        nxt, taps, z = serial_step(row, token)
        mx.async_eval(nxt)
    else:
        t0, nxt, taps, z = ahead.since, ahead.token, ahead.taps, ahead.row
    session.feed([token], taps)
    if builds_ahead(row, room):
        build_ahead(row, nxt)
    nxt = finite(nxt.item(), session)     # (not finite: the session, step ahead and all, is reset)
    t_read = time.perf_counter()
    if session.ahead is not None:
        session.ahead.since = t_read
        if nxt in row.request.stop_tokens:
            undo_ahead(session)
    row.score(z, [nxt])
    row.stats.t_serial += t_read - t0
    row.stats.serial_steps += 1
    row.control.observe_serial(t_read - t0)
    return nxt


def _round(row: Row, bonus: int, n: int) -> list[int]:
    """One speculative round; returns the tokens it emits (accepted drafts + next token)."""
    steps = round_steps(row, bonus, n)
    verdict = steps.send(verify(row.session, bonus, next(steps)))
    return steps.send(verdict.tolist())


def round_steps(row: Row, bonus: int, n: int):
    """A round as one lazy graph read back once, in steps (a generator): it yields the drafts
    and is sent the verify pass over them, yields its verdict and is sent it read, then yields
    the tokens it emits. A batch (batch.py) verifies and reads many rows' rounds at once."""
    session, sampler, noise = row.session, row.sampler, row.noise
    t_start = time.perf_counter()
    _catch_up(row, n, t_start)
    t0 = time.perf_counter()
    probe = row.probing()
    # Bonus at position P: the drafts and the token after them sit at P+1..P+n+1.
    g = noise.at(len(session.tokens) + 1, n + 1, session.target.config.vocab_size)
    drafts, draft_logits = draft(row, bonus, n, None if g is None else g[:n])
    t1 = time.perf_counter()
    target_logits, taps = yield drafts
    verified, codes = row.verified(target_logits, bonus, drafts)
    a, nxt = accept(drafts, draft_logits, verified, sampler, g,
                    None if sampler.coupled else noise.next_key(),
                    row.constraint.allowed(target_logits, drafts))
    nxt = nxt.astype(mx.int32)
    if row.processors:      # (without processors no row is theirs to spoil: no code to read)
        # the first unusable row among those serial decoding reads (up to the one after the
        # accepted drafts) ends the run, as it would have there
        broken = ((codes != 0) & (mx.arange(codes.shape[0]) <= a)).astype(mx.int32)
        nxt = mx.where(broken.any(), codes[mx.argmax(broken)], nxt)
    nxt = mx.where(mx.isfinite(target_logits).all(), nxt, -1)  # read below
    read = yield mx.concatenate([a.reshape(1), nxt.reshape(1), drafts]).astype(mx.int32)
    finite(read[1], session)
    a, out = read[0], read[2:2 + read[0]] + [read[1]]
    t2 = time.perf_counter()
    out = _through_stop(out, row.request.stop_tokens)
    row.score(target_logits[:len(out)], out)     # the verify rows the tokens were chosen from
    row.constraint.settle(len(out) - 1)   # the accepted drafts stay; the rest roll back
    t3 = time.perf_counter()
    commit(session, bonus, read[2:], taps, keep=len(out))
    t4 = time.perf_counter()
    row.count_round(n, a, (t_start, t0, t1, t2, t3, t4))
    row.stats.probe_rounds += probe
    yield out


def _catch_up(row: Row, n: int, t_start: float):
    """The drafter takes the taps of the tokens it has not seen (the prompt, serial steps).
    A long catch-up is work per token, not per round: computed here, before the round's
    clock starts, so the controller prices rounds without it."""
    caught_up = row.session.flush()
    if caught_up > n + 1:
        mx.eval(row.session.draft_cache.arrays())
        row.control.observe_catchup(time.perf_counter() - t_start, caught_up)


def _through_stop(out: list[int], stops) -> list[int]:
    """A stop token among the accepted drafts ends the run there; like serial decoding, the
    stop token is emitted but never fed to the target."""
    stop_at = next((i for i, t in enumerate(out) if t in stops), len(out) - 1)
    return out[:stop_at + 1]
