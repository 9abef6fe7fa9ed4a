"""Where a prefill stops between its pieces (loop.py ``prefill``), so that a long prompt can be
seen (a progress callback after each piece) and stopped (a cancellation between two pieces)
without changing a bit of what it computes.

A prompt's prefill is already cut at its checkpoints (the prompt cache's message ends and
every ``CHECKPOINT_EVERY`` tokens); each stretch between two of them is fed in pieces counted
from the stretch's start, which compute exactly what one step over the stretch computes
(tests/test_prefill_pieces.py): every piece size is a multiple of the Mamba scan's chunk (128
positions), so the scan's chunks stay where they were, and divides the target's own longest
step (``prefill_step``, 2048), so its cuts are among ours. A piece that would leave a tail of at
most ``serial_max`` tokens (the SSM runs those position by position, the chunked scan the rest,
equal only up to rounding) is not cut there unless the target's own step cuts there too.

The sizes are a measured choice (benchmarks/bench_prefill_pieces.py, docs/serve.md): about a
second a piece on the 2-core CPU. A token's cost grows with the context before it (attention),
so the pieces shrink as the prompt grows: ``PIECE`` (512) tokens, half that from 4096 tokens
of context, a quarter from 8192 (each size divides the one before, so the cuts stay on its
multiples). Feeding a prompt in pieces costs within the noise of one step. Beside rows that
decode, a batch runs the same pieces, whole, as its per-step budget of prompt tokens accrues
(``PREFILL_BUDGET``, serve/batching.py)."""

from __future__ import annotations

PIECE = 512
CHUNK = 128         # the Mamba scan's chunk of a target that does not name its own
SIZES = ((0, PIECE), (4096, PIECE // 2), (8192, PIECE // 4))   # (from this context on, size)
# a batch's prefill beside rows decoding: the prompt tokens per step, on average (the server's
# --prefill-budget; docs/batching.md "Prefill beside decoding", benchmarks/bench_prefill_stall.py)
PREFILL_BUDGET = 3


def size_at(position: int, sizes=SIZES) -> int:
    """The piece size after ``position`` tokens of context."""
    return next(size for start, size in reversed(sizes) if position >= start)


def ends(start: int, stops: list[int], target, sizes=SIZES) -> list[int]:
    """The positions where a prefill from ``start`` stops: every ``stops`` (its checkpoints,
    then the prompt's end), and every piece between them (see the module's note). ``target``
    may name its own step's cuts (``prefill_step``) and how long a block it runs serially
    (``serial_max``)."""
    step = getattr(target, "prefill_step", None)
    serial = getattr(target, "serial_max", 0)
    out = []
    for stop in stops:
        cut = start + size_at(start, sizes)
        while cut < stop:
            if stop - cut > serial or (step is not None and (cut - start) % step == 0):
                out.append(cut)
            cut += size_at(cut, sizes)
        out.append(stop)
        start = stop
    return out


def silent(stops: list[int], wanted, target) -> set[int]:
    """Where a prefill that stops at ``stops`` (its start, its cuts and its end) may also stop
    without a bit of what it computes changing, near each of ``wanted``: the last position at
    or before it that is a whole number of the Mamba scan's chunks (``scan_chunk``) past the
    stop before it, so the scan's chunks stay where they were (as the pieces'), and more than
    ``serial_max`` tokens before the stop after it, so no stretch becomes one the SSM runs
    position by position. A checkpoint there costs its snapshot alone, and a later prompt
    that shares the stops before it computes from it what its own cold run computes, to the
    bit."""
    chunk = getattr(target, "scan_chunk", CHUNK)
    serial = getattr(target, "serial_max", 0)
    out = set()
    for want in wanted:
        before = max((s for s in stops if s <= want), default=None)
        if before is None:
            continue
        at = before + (want - before) // chunk * chunk
        after = min((s for s in stops if s > at), default=None)
        if at > before and after is not None and after - at > serial:
            out.add(at)
    return out
