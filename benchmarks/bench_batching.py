"""Aggregate decoding throughput of rows decoded together (decode/batch.py) against the same
requests decoded one after another (decode/loop.py), at batch 1, 2 and 4, serial and
speculative, in one run (issue 34; the loop alone, no server). Demo pair, greedy, DSpark
drafter, N = 3, no stop tokens (every request generates ``--tokens``); the clock covers each
request's prefill too. Repeats are interleaved; medians, and each ratio's spread.

    python benchmarks/bench_batching.py [--tokens 64] [--repeats 5] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_batching.py
"""

import argparse
import json
import os
import statistics
import time

import mlx_dspark as md
from mlx_dspark.decode.batch import decode_batch
from mlx_dspark.decode.loop import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
           "class Stack:\n    def __init__(self):", "def quicksort(xs):"]


def in_turn(pair, requests):
    t0 = time.perf_counter()
    n = sum(len(list(decode(Session(pair.target, pair.drafter), r))) for r in requests)
    return n / (time.perf_counter() - t0)


def together(pair, requests):
    t0 = time.perf_counter()
    out = decode_batch([Session(pair.target, pair.drafter) for _ in requests], requests)
    return sum(map(len, out)) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pair = md.load()
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    cases = [(b, spec) for spec in ("off", "on") for b in (1, 2, 4)]
    requests = {(b, spec): [Request(p, max_tokens=args.tokens, speculative=spec, num_draft=3)
                            for p in prompts[:b]] for b, spec in cases}
    for case in cases:                                   # warm-up: compiled kernels per shape
        in_turn(pair, requests[case])
        together(pair, requests[case])
    runs = {case: ([], []) for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            runs[case][0].append(in_turn(pair, requests[case]))
            runs[case][1].append(together(pair, requests[case]))
    serial_alone = statistics.median(runs[(1, "off")][0])
    rows = []
    for (b, spec) in cases:
        turn, batch = runs[(b, spec)]
        ratios = sorted(x / y for x, y in zip(batch, turn))
        rows.append(dict(batch=b, speculative=spec, in_turn_tok_s=statistics.median(turn),
                         batched_tok_s=statistics.median(batch),
                         batched_over_in_turn=statistics.median(ratios),
                         spread=[ratios[0], ratios[-1]],
                         batched_over_serial_alone=statistics.median(batch) / serial_alone))
    if args.json:
        print(json.dumps(rows))
        return
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else \
        "stock BLAS"
    print(f"demo pair, {args.tokens} tokens per request, {args.repeats} repeats, {blas}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("batch  speculative  in turn tok/s  batched tok/s  batched/in turn [spread]  "
          "batched/serial alone")
    for r in rows:
        print(f"{r['batch']:>5}  {r['speculative']:>11}  {r['in_turn_tok_s']:>13.1f}  "
              f"{r['batched_tok_s']:>13.1f}  {r['batched_over_in_turn']:>6.2f}x "
              f"[{r['spread'][0]:.2f}-{r['spread'][1]:.2f}]  "
              f"{r['batched_over_serial_alone']:>17.2f}x")


if __name__ == "__main__":
    main()
