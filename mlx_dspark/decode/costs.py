"""The round-cost curve ``num_draft="auto"`` chooses its length on (length.py), measured on a
scratch session of the pair: a serial step, and a round of each length (the drafter's
``propose(n)`` and the target's verify of ``n + 1`` tokens in one graph, as the loop computes
them). Also the split timing ``mlx-dspark bench`` reports as c and verify."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from ..policy import length
from .session import Session

CALIBRATION_TOKENS = 32   # the scratch context the curve is measured after
CALIBRATION_REPEATS = 3


def time_round(session: Session, bonus: int, n: int, split: bool = True) -> tuple:
    """Wall times (s) of one evaluated ``propose(n)`` after ``bonus`` and of the verify of
    the ``n + 1`` tokens, on ``session``, whose caches are left as they were. ``split``
    False: both in one graph, evaluated once, as a round computes them (the time is then
    all in the second figure)."""
    target, drafter = session.target, session.drafter
    state = session.cache.snapshot()
    t0 = time.perf_counter()
    tokens, _ = drafter.propose(bonus, n, cache=session.draft_cache)   # leaves the cache
    block = mx.concatenate([mx.array([bonus], dtype=mx.int32), tokens])[None]
    if split:
        mx.eval(block)
    t1 = time.perf_counter()
    mx.eval(target.verify(block, session.cache, tap_layers=session.tap_layers))
    t2 = time.perf_counter()
    target.commit(session.cache, n + 1)
    session.cache.restore(state)
    return length.duration(t1 - t0), length.duration(t2 - t1)


def scratch(target, drafter, prompt: list[int]) -> tuple[Session, int]:
    """A session of its own holding ``prompt`` (the drafter caught up), and the greedy
    token after it."""
    session = Session(target, drafter)
    logits, taps = target.step(mx.array([prompt]), session.cache,
                               tap_layers=session.tap_layers, last_only=True)
    session.feed(list(prompt), taps)
    session.flush()
    bonus = int(mx.argmax(logits[0, -1]).item())
    mx.eval(session.draft_cache.arrays())
    return session, bonus


def calibrate(target, drafter, repeats: int = CALIBRATION_REPEATS) -> tuple:
    """A serial step's seconds and a round's cost at each length ``1..length.longest(drafter)`` in
    such steps: medians of ``repeats`` (after one warm-up, which also compiles each length's
    kernels), the lengths interleaved so that a load swing hits them all."""
    vocab = target.config.vocab_size
    session, bonus = scratch(target, drafter, [i % vocab for i in range(CALIBRATION_TOKENS)])
    lengths = range(1, length.longest(drafter) + 1)
    steps, rounds = [], {n: [] for n in lengths}
    for _ in range(repeats + 1):
        mark = session.cache.mark()
        t0 = time.perf_counter()
        mx.eval(target.step(mx.array([[bonus]]), session.cache,
                            tap_layers=session.tap_layers))   # as "auto"'s serial steps
        steps.append(length.duration(time.perf_counter() - t0))
        session.cache.rewind(mark)
        for n in lengths:
            rounds[n].append(sum(time_round(session, bonus, n, split=False)))
    step = statistics.median(steps[1:])
    return step, [statistics.median(rounds[n][1:]) / step for n in lengths]


def measured_curve(target, drafter) -> length.Curve:
    """This pair's :class:`~.length.Curve`: measured on the first call and kept on the drafter
    (it is the drafter's and its target's cost on this machine, not a request's), so what every
    request's rounds measure refreshes it for the next."""
    curve = getattr(drafter, "_auto_curve", None)
    if curve is None:
        step, loaded = calibrate(target, drafter)
        curve = length.Curve(length.line(loaded), step)
        object.__setattr__(drafter, "_auto_curve", curve)   # not a module parameter
    return curve
