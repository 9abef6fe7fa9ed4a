"""Prefill beside decoding (issue 42, docs/batching.md "Prefill beside decoding"): while a
6,079-token prompt joins a server's batch, how fast does a row that was already streaming go,
and how fast is the long prompt prefilled, each against itself alone. Demo pair, greedy,
``serve``'s engine (``max_batch`` 4, no prompt cache), speculation off for the streaming row
(its pace is then one step per token, the same before and during).

For each setting a fresh process runs: the long prompt alone (its prefill throughput: prompt
tokens / the time from its join to its first token); then a streaming row, its pace just before
(the last 100 tokens before the long prompt is sent) and during the long prompt's prefill
(tokens it emitted between the long prompt's join and first token, over that time), and the
long prompt's prefill throughput there. ``--budgets`` are ``--prefill-budget`` settings;
``--today PATH`` also runs the code of another checkout (``git worktree add PATH <commit>``)
with its own defaults. Settings alternate within each repeat; medians. Times are the process's
CPU time (``CLOCK``): on the shared 2-core machine the wall clock's load swings by the minute.

    git worktree add --detach /tmp/engine-today <commit>
    python benchmarks/bench_prefill_stall.py --today /tmp/engine-today --budgets 0.5 0.75 1 2 512
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import checkout

LONG = 6079
# the process's CPU time (all its threads): other processes on a shared machine slow the wall
# clock by the minute, which would move "before" against "during"; the work done does not move
CLOCK = time.process_time
PROMPT = "def read_config(path):"


def child(budget: int | None, source: str | None) -> dict:
    if source is not None:
        checkout.use(source)
    import numpy as np

    from mlx_dspark import api
    from mlx_dspark.serve.engine import Engine, Job

    pair = api.load()
    options = {} if budget is None else {"prefill_budget": budget}
    engine = Engine(lambda: pair, max_queue=4, cache_bytes=0, max_batch=4, **options)
    engine.start()
    heard, done = [], threading.Event()

    class Timed(Job):
        def emit(self, kind, item):
            heard.append((CLOCK(), self, kind))
            if kind == "chunk" and item.finish_reason is not None or kind == "error":
                done.set()

    def submit(request) -> Job:
        job = Timed(request, None)
        engine.submit(job)
        return job

    def times(job, kind):
        return [t for t, who, what in list(heard) if who is job and what == kind]

    long = np.random.default_rng(0).integers(5, 1000, LONG).tolist()

    def prefill(job) -> tuple[float, float]:
        """When ``job`` joined and when its first token came."""
        while not times(job, "chunk"):
            time.sleep(0.01)
        return times(job, "started")[0], times(job, "chunk")[0]

    api.generate(pair, long[:600], max_tokens=2)     # kernels compiled before any clock
    start, first = prefill(submit(api.make_request(pair, long, 1, temperature=0)))
    alone = LONG / (first - start)
    done.wait()
    done.clear()
    row = submit(api.make_request(pair, PROMPT, 100_000, temperature=0, speculative="off"))
    while len(times(row, "chunk")) < 400:
        time.sleep(0.01)
    before = times(row, "chunk")[-101:]
    job = submit(api.make_request(pair, long, 1, temperature=0))
    start, first = prefill(job)
    during = [t for t in times(row, "chunk") if start <= t <= first]
    engine.cancel(row)
    engine.stop()
    return {"pace": (len(during) / (first - start)) / (100 / (before[-1] - before[0])),
            "prefill": (LONG / (first - start)) / alone, "alone_tok_s": alone,
            "decode_tok_s": 100 / (before[-1] - before[0]), "prefill_s": first - start,
            "code": os.path.dirname(api.__file__)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.75, 1, 2, 512])
    p.add_argument("--today", metavar="PATH", help="also run another checkout's code")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.budget, args.source)), flush=True)
        os._exit(0)         # the engine's daemon thread may not outlive a normal exit cleanly
    settings = ([("today", ["--source", args.today])] if args.today else []) + \
        [(f"{b:g}", ["--budget", str(b)]) for b in args.budgets]
    runs = {name: [] for name, _ in settings}
    for _ in range(args.repeats):
        for name, extra in settings:
            out = subprocess.run([sys.executable, __file__, "--child", *extra], check=True,
                                 capture_output=True, text=True, env=dict(os.environ))
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "code"}
            | {"code": rs[0]["code"]} for name, rs in runs.items()}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'setting':>8}  {'pace kept':>9}  {'prefill kept':>12}  {'decode tok/s':>12}  "
          f"{'alone prefill tok/s':>19}  {'prefill s':>9}  code")
    for name, r in rows.items():
        print(f"{name:>8}  {r['pace']:>8.2f}x  {r['prefill']:>11.2f}x  {r['decode_tok_s']:>12.1f}  "
              f"{r['alone_tok_s']:>19.1f}  {r['prefill_s']:>9.1f}  {r['code']}")


if __name__ == "__main__":
    main()
