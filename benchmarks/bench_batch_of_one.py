"""Decoding at batch 1 (issue 42, item 1: ``decode()`` is a batch of one): greedy tokens/s,
serial and speculative (DSpark, N = 3), on the demo pair, this checkout's code against
another checkout's (``--today PATH``: ``git worktree add --detach PATH <commit>``), each in a
fresh process, the two alternating, ``--repeats`` times; medians, and mine / today's. Tokens/s
is the time from a reply's first token to its last, as a consumer of ``decode`` sees it (the
driver's bookkeeping included), over four 256-token replies, on the wall clock and on the
process's CPU time (all its threads: on a shared machine the wall clock's load swings).

    git worktree add --detach /tmp/engine-today <commit>
    python benchmarks/bench_batch_of_one.py --today /tmp/engine-today --repeats 7
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import checkout

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
           "class Stack:\n    def __init__(self):", "The quick brown fox"]
TOKENS = 256


def child(source: str | None) -> dict:
    if source is not None:
        checkout.use(source)
    import mlx_dspark as md
    from mlx_dspark.decode.session import Session
    try:
        from mlx_dspark.decode.batch import decode
    except ImportError:                 # the loop driver's checkout: decode() was the loop's
        from mlx_dspark.decode.loop import decode

    pair = md.load()
    out = {}
    for mode, clock in (("off", time.perf_counter), ("on", time.perf_counter),
                        ("off cpu", time.process_time), ("on cpu", time.process_time)):
        requests = [md.api.make_request(pair, p, TOKENS, speculative=mode.split()[0],
                                        num_draft=3)
                    for p in PROMPTS]
        list(decode(Session(pair.target, pair.drafter), requests[0]))      # warm
        seconds = tokens = 0
        for request in requests:
            stream = decode(Session(pair.target, pair.drafter), request)
            next(stream)
            t0, n = clock(), sum(1 for _ in stream)
            seconds, tokens = seconds + clock() - t0, tokens + n
        out[mode] = tokens / seconds
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--today", metavar="PATH", help="the other checkout (required)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.source)), flush=True)
        return
    if args.today is None:
        p.error("--today PATH is required")
    runs = {"today": [], "mine": []}
    for _ in range(args.repeats):
        for name, extra in (("today", ["--source", args.today]), ("mine", [])):
            out = subprocess.run([sys.executable, __file__, "--child", *extra], check=True,
                                 capture_output=True, text=True, env=dict(os.environ))
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for mode, name in (("off", "serial"), ("on", "speculative"), ("off cpu", "serial, CPU"),
                       ("on cpu", "spec., CPU")):
        today = statistics.median(r[mode] for r in runs["today"])
        mine = statistics.median(r[mode] for r in runs["mine"])
        pairs = sorted(m[mode] / t[mode] for m, t in zip(runs["mine"], runs["today"]))
        print(f"{name:>11}: today {today:7.1f} tok/s, batch of one {mine:7.1f} tok/s, "
              f"{mine / today:.3f}x [paired {pairs[0]:.3f}-{pairs[-1]:.3f}]")


if __name__ == "__main__":
    main()
