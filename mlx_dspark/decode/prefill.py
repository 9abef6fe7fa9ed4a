"""A prompt through the target (the loop's first step), in pieces: :func:`prefill` feeds it
whole, :func:`prefill_steps` one piece per ``next()``, so that a server can interleave a
joining request's prefill with the steps of the rows already decoding (serve/batching.py).
Both compute the same pieces (pieces.py), to the bit."""

from __future__ import annotations

import time

import mlx.core as mx

from ..models.media_rows import step_input
from . import pieces
from .session import Session


def prefill(session: Session, prompt: list[int], tap: bool, progress=None) -> mx.array:
    """Feed the prompt (or the part after the longest prefix the session holds, Session.reuse)
    and return the last logits.

    The prompt goes in pieces (pieces.py) that compute what one step over it computes, to the
    bit: cut at the session's ``cuts`` (its ``checkpoints``, and before the last token when it
    keeps that state; ``session.checkpoint`` runs there: a prompt cache snapshots it) and every
    few hundred tokens. ``progress(done, total, seconds)`` hears of the start and each piece,
    and may raise to stop there. The cuts depend on the prompt alone, so a run continued from
    a checkpoint computes exactly what the cold run did."""
    return to_the_end(prefill_steps(session, prompt, tap, progress))


def prefill_steps(session: Session, prompt: list[int], tap: bool, progress=None):
    """:func:`prefill` as a generator: it yields after each piece (its progress reported) and
    returns the last logits."""
    session.reuse(prompt)
    cuts = session.cuts(prompt)
    t0, report = time.perf_counter(), progress or (lambda *_: None)
    report(len(session.tokens), len(prompt), 0.0)
    for end in pieces.ends(len(session.tokens), cuts + [len(prompt)], session.target):
        new = prompt[len(session.tokens):end]
        logits, taps = session.target.step(step_input(session.target, new), session.cache,
                                           tap_layers=session.tap_layers if tap else None,
                                           last_only=True)
        session.feed(new, taps)
        if end < len(prompt) or progress is not None:   # done before the next (its memory
            mx.eval(logits, taps, session.cache.arrays())   # freed), or before it is reported
        if end in cuts:
            session.checkpoint(prompt)
        report(end, len(prompt), time.perf_counter() - t0)
        if end < len(prompt):
            yield end
    return logits[0, -1]


def to_the_end(steps):
    """Run the generator ``steps`` through; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
