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


def prefill_steps(session: Session, prompt: list[int], tap: bool, progress=None,
                  scored: int = 0):
    """:func:`prefill` as a generator: it yields after each piece (its progress reported) and
    returns the last logits; with ``scored``, after the rows of the ``scored`` positions before
    the last (``[scored + 1, V]``: the rows the prompt's last ``scored`` tokens follow, which a
    thinking budget wrote, not chose, and scores; the session must hold none of them)."""
    session.reuse(prompt)
    cuts = session.cuts(prompt)
    t0, report = time.perf_counter(), progress or (lambda *_: None)
    report(len(session.tokens), len(prompt), 0.0)
    rows = []
    for end in pieces.ends(len(session.tokens), cuts + [len(prompt)], session.target):
        start = len(session.tokens)
        new = prompt[start:end]
        also = end - 1 - max(start, len(prompt) - 1 - scored)
        logits, taps = session.target.step(step_input(session.target, new), session.cache,
                                           tap_layers=session.tap_layers if tap else None,
                                           last_only=True, **({"also": also} if also > 0 else {}))
        if also >= 0 and scored:
            rows.append(logits[0])
        session.feed(new, taps)
        if end < len(prompt) or progress is not None:   # done before the next (its memory
            mx.eval(logits, taps, session.cache.arrays())   # freed), or before it is reported
        if end in cuts:
            session.checkpoint(prompt)
        report(end, len(prompt), time.perf_counter() - t0)
        if end < len(prompt):
            yield end
    return mx.concatenate(rows) if scored else logits[0, -1]


def reuse(session: Session, prompt: list[int], scored: int = 0) -> int:
    """Put ``session`` at the longest prefix of ``prompt`` it holds (Session.reuse) that
    leaves the rows of the ``scored`` positions before the last to compute, and return its
    length (a state past them starts over: rare, a budget of 0 on a cached prompt)."""
    if session.reuse(prompt) > len(prompt) - 1 - scored:
        session.reset()
    return len(session.tokens)


def to_the_end(steps):
    """Run the generator ``steps`` through; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
