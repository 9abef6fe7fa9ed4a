"""Issue 32's measurement: ``num_draft="auto"`` against every fixed N, with every drafter kind,
on the demo pair and the bench's code, math and chat prompts, in one ``mlx-dspark bench`` run.

Per domain and drafter it reports the best fixed N's speedup over serial (forced speculation),
auto's, auto / best (the issue asks for no worse than 0.95), auto / N = 3, and the same for the
break-even mode (``speculative="auto"``) at auto length against at N = 3: what making it the
default would change.

``--clock cpu`` times with the process's CPU time (``time.process_time``) in place of the wall
clock, for the whole run, the controller's own decisions included: on a shared machine whose
load average is several times its cores, wall times swing several-fold within a run and say
more about the neighbours than about the engine; CPU time is what the run would take on a core
of its own. Run single-threaded (OPENBLAS_NUM_THREADS=1) so that CPU time is one core's.

    python benchmarks/bench_auto_length.py [--clock cpu] [--limit 2] [--repeats 3] [-m 48]
    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/bench_auto_length.py --clock cpu
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--limit", default="2")
    ap.add_argument("--repeats", default="3")
    ap.add_argument("-m", "--max-tokens", default="48")
    ap.add_argument("--num-draft", default="1,3,5,7,auto")
    ap.add_argument("--drafters", default="all", help="all, or a comma-separated list")
    ap.add_argument("--json", metavar="FILE", help="also write the bench's report here")
    args = ap.parse_args()
    if args.clock == "cpu":
        time.perf_counter = time.process_time     # before anything reads a clock
    from mlx_dspark import cli

    out = io.StringIO()
    argv = ["bench", "--drafters", args.drafters, "--num-draft", *args.num_draft.split(","),
            "--limit", args.limit, "--repeats", args.repeats, "-m", args.max_tokens, "--json"]
    load = os.getloadavg()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    if code:
        sys.exit(code)
    report = json.loads(out.getvalue())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    m = report["machine"]
    print(f"clock: {args.clock}; BLAS: {m['blas']}; load average before/after: "
          f"{load[0]:.1f} / {os.getloadavg()[0]:.1f} on {m['cpu_count']} cores; "
          f"mlx-dspark {' '.join(argv)}")
    print(table(report["results"]))


def table(results) -> str:
    lines = ["| domain | drafter | best fixed N: speedup | auto: speedup (drafts/round) | "
             "auto / best | auto / N=3 | break-even at auto / at N=3 |",
             "|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["domain"], r["drafter"]) for r in results)
    for domain, drafter in keys:
        rows = {r["num_draft"]: r for r in results
                if r["domain"] == domain and r["drafter"] == drafter}
        auto, fixed = rows.pop("auto"), rows
        best = max(fixed.values(), key=lambda r: r["speedup"])
        three = fixed.get(3)
        lines.append(
            f"| {domain} | {drafter} | N={best['num_draft']}: {best['speedup']:.2f}x | "
            f"{auto['speedup']:.2f}x ({auto['drafts_per_round']:.1f}) | "
            f"{auto['speedup'] / best['speedup']:.2f} | "
            + (f"{auto['speedup'] / three['speedup']:.2f} | "
               f"{auto['auto_vs_serial']:.2f}x / {three['auto_vs_serial']:.2f}x |" if three
               else "- | - |"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
