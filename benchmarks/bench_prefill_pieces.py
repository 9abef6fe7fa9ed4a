"""The prefill in pieces measured (decode/pieces.py, docs/serve.md): what a piece of each size
costs at each context length (how long a cancellation or a progress line waits), and what
feeding a prompt in pieces costs against one step over it (``target.step`` over the whole
prompt, which cuts at 2048 itself), on the embedded demo pair, in this process.

    python benchmarks/bench_prefill_pieces.py [--tokens 4096] [--repeats 5] [--context 16384]

Pieces and one step run interleaved, ``--repeats`` times each on the same random prompt;
medians with their [min-max] spread, and the ratio of the medians. Say the machine's load
(``uptime``) with the numbers: on a shared CPU the spread is the honest part."""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_dspark import api
from mlx_dspark.decode import pieces
from mlx_dspark.decode.loop import prefill


def one_step(pair, prompt):
    cache = pair.target.make_cache()
    logits, _ = pair.target.step(mx.array([prompt]), cache, last_only=True)
    mx.eval(logits, cache.arrays())


def in_pieces(pair, prompt):
    session = pair.session()
    mx.eval(prefill(session, prompt, tap=False))


def piece_costs(pair, prompt, sizes, at):
    """Seconds of one piece of each size after each of ``at`` tokens of context (the context
    grown once, each piece undone after it is timed)."""
    out, cache, held = {size: [] for size in sizes}, pair.target.make_cache(), 0
    for start in at:
        if start > held:
            logits, _ = pair.target.step(mx.array([prompt[held:start]]), cache,
                                         last_only=True)
            mx.eval(logits, cache.arrays())
            held = start
        for size in sizes:
            mark = cache.mark()
            t0 = time.perf_counter()
            logits, _ = pair.target.step(mx.array([prompt[start:start + size]]), cache,
                                         last_only=True)
            mx.eval(logits, cache.arrays())
            out[size].append(time.perf_counter() - t0)
            cache.rewind(mark)
    return out


def spread(xs) -> str:
    return f"{statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=0,
                   help="also time the pieces up to this many tokens of context")
    args = p.parse_args()
    pair = api.load(drafter="none")
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, pair.target.config.vocab_size,
                          max(args.tokens, args.context + 1024)).tolist()
    in_pieces(pair, prompt[:600])           # compile and warm up both paths
    one_step(pair, prompt[:600])

    at = [a for a in (0, 2048, 4096, 8192, 16384, 32768) if a + 1024 <= len(prompt)]
    print(f"one piece's time at a context of {at} tokens (the schedule: {pieces.SIZES}):")
    for size, row in piece_costs(pair, prompt, (128, 256, 512, 1024), at).items():
        print(f"  {size:5d} tokens: " + ", ".join(f"{t:.2f} s" for t in row))

    times = {"one step": [], "pieces": []}
    for _ in range(args.repeats):
        for name, run in (("one step", one_step), ("pieces", in_pieces)):
            t0 = time.perf_counter()
            run(pair, prompt[:args.tokens])
            times[name].append(time.perf_counter() - t0)
    print(f"prefill of {args.tokens} tokens, {args.repeats} repeats interleaved "
          f"(pieces: {pieces.SIZES}):")
    for name, xs in times.items():  # (on the first --tokens of the prompt)
        print(f"  {name:9s} {spread(xs)}")
    ratios = [b / a for a, b in zip(times["one step"], times["pieces"])]
    print(f"  pieces / one step: {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] (per repeat)")


if __name__ == "__main__":
    main()
