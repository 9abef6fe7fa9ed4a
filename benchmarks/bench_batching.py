"""Aggregate decoding throughput of rows decoded together (decode/batch.py) against the same
requests decoded one after another (decode/loop.py), at batch 1, 2 and 4, speculation off, on
and auto, in one run (issue 34; the loop alone, no server), and the share of the rows' steps
that were speculative rounds (probes not counted): under "auto", which batch sizes the
controller speculates at. Demo pair, greedy, DSpark drafter, N = 3 (``--num-draft auto``:
each round's length chosen), no stop tokens (every request generates ``--tokens``); the clock
covers each request's prefill too. Repeats are interleaved; medians, and each ratio's spread.

    python benchmarks/bench_batching.py [--tokens 64] [--repeats 5] [--modes off,on,auto]
        [--num-draft 3|auto] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_batching.py
"""

import argparse
import json
import os
import statistics
import time

import mlx_dspark as md
from mlx_dspark.decode.batch import Batch
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request
from mlx_dspark.stats import Stats

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
           "class Stack:\n    def __init__(self):", "def quicksort(xs):"]


def in_turn(pair, requests, stats):
    t0 = time.perf_counter()
    n = sum(len(list(decode(Session(pair.target, pair.drafter), r, s)))
            for r, s in zip(requests, stats))
    return n / (time.perf_counter() - t0)


def together(pair, requests, stats, costs=None):
    """Tokens/s of ``requests`` decoded as one batch; ``costs`` (a dict) collects, per live
    batch size, what "auto" decided on there: its round's cost in (batched) serial steps
    and its predicted speedup (at batch 1, the row's own controller's)."""
    t0 = time.perf_counter()
    batch = Batch()
    rows = [batch.add(Session(pair.target, pair.drafter), r, s) for r, s in zip(requests, stats)]
    n = sum(len(row.tokens) for row in rows)
    while batch.rows:
        n += sum(len(row.tokens) for row in batch.step())
    rate = n / (time.perf_counter() - t0)
    if costs is not None:
        controls = [((1,), rows[0].control)] if len(rows) == 1 else batch.control.sizes.items()
        for (*_, size), control in controls:
            costs.setdefault(size, []).append((control.round_cost, control.decided))
    return rate


def speculated(stats) -> float:
    """The share of the rows' steps that were speculative rounds other than probes."""
    steps = sum(s.rounds + s.serial_steps for s in stats)
    return sum(s.rounds - s.probe_rounds for s in stats) / steps if steps else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="off,on,auto", help="speculative modes, comma-separated")
    ap.add_argument("--num-draft", default="3", help="drafts per round, or auto")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pair = md.load()
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    num_draft = args.num_draft if args.num_draft == "auto" else int(args.num_draft)
    modes = args.modes.split(",")
    cases = [(b, spec) for spec in modes for b in (1, 2, 4)]
    requests = {(b, spec): [Request(p, max_tokens=args.tokens, speculative=spec,
                                    num_draft=num_draft) for p in prompts[:b]]
                for b, spec in cases}
    fresh = {case: lambda case=case: [Stats() for _ in requests[case]] for case in cases}
    for case in cases:                                   # warm-up: compiled kernels per shape
        in_turn(pair, requests[case], fresh[case]())
        together(pair, requests[case], fresh[case]())
    runs, costs = {case: ([], [], [], []) for case in cases}, {}
    for _ in range(args.repeats):
        for case in cases:
            alone, batched = fresh[case](), fresh[case]()
            runs[case][0].append(in_turn(pair, requests[case], alone))
            runs[case][1].append(together(pair, requests[case], batched,
                                          costs if case[1] == "auto" else None))
            runs[case][2].append(speculated(alone))
            runs[case][3].append(speculated(batched))
    base = (1, "off") if "off" in modes else cases[0]
    serial_alone = statistics.median(runs[base][0])
    rows = []
    for (b, spec) in cases:
        turn, batch, spec_turn, spec_batch = runs[(b, spec)]
        ratios = sorted(x / y for x, y in zip(batch, turn))
        rows.append(dict(batch=b, speculative=spec, in_turn_tok_s=statistics.median(turn),
                         batched_tok_s=statistics.median(batch),
                         batched_over_in_turn=statistics.median(ratios),
                         spread=[ratios[0], ratios[-1]],
                         batched_over_serial_alone=statistics.median(batch) / serial_alone,
                         speculated_in_turn=statistics.median(spec_turn),
                         speculated_batched=statistics.median(spec_batch)))
    if args.json:
        print(json.dumps(rows))
        return
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else \
        "stock BLAS"
    print(f"demo pair, num_draft {args.num_draft}, {args.tokens} tokens per request, "
          f"{args.repeats} repeats, {blas}, load {os.getloadavg()[0]:.2f} "
          f"(the {base[1]} rows of batch 1 decoded in turn are the 'serial alone' base)")
    print("batch  speculative  in turn tok/s  batched tok/s  batched/in turn [spread]  "
          "batched/serial alone  speculated in turn / batched")
    for r in rows:
        print(f"{r['batch']:>5}  {r['speculative']:>11}  {r['in_turn_tok_s']:>13.1f}  "
              f"{r['batched_tok_s']:>13.1f}  {r['batched_over_in_turn']:>6.2f}x "
              f"[{r['spread'][0]:.2f}-{r['spread'][1]:.2f}]  "
              f"{r['batched_over_serial_alone']:>17.2f}x  "
              f"{r['speculated_in_turn']:>10.0%} / {r['speculated_batched']:.0%}")
    if costs:
        print("what batched auto decided on, per live batch size (medians over the runs): a "
              "round's cost in serial steps of that size, predicted speedup")
        for size in sorted(costs):
            cost = [c for c, _ in costs[size] if c is not None]
            speedup = [p for _, p in costs[size] if p is not None]
            print(f"{size:>5}  round {_med(cost):>5} serial steps  predicted {_med(speedup)}")


def _med(values) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


if __name__ == "__main__":
    main()
