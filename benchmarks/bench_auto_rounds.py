"""Where ``num_draft="auto"`` spends its time, against fixed lengths: one demo drafter forced to
speculate at N = 1, 2, 3 and auto on the bench's prompts (2 per domain, 48 tokens, interleaved
per prompt), timed with the process's CPU time. Per mode: tokens per CPU second, tokens per
round, and each draft length's count of rounds and median round time (the controller's own
clock readings), then the pair's cost curve as loaded and as it stands at the end.

It separates the two ways "auto" can lose: rounds dearer than a fixed length's rounds of the
same length (there were none), or lengths chosen on a wrong price (DFlash's 4 to 7 drafts on
stale and noisy prices, docs/drafters.md).

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_auto_rounds.py dflash [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", help="a demo drafter name: dspark, mtp, eagle3, dflash")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    time.perf_counter = time.process_time      # the loop's clock too, before it is read
    import mlx_dspark as md
    from mlx_dspark.cli.bench import PROMPTS
    from mlx_dspark.policy import controller

    modes = [1, 2, 3, "auto"]
    pair = md.load(drafter=args.drafter)
    current, times = [None], {m: collections.defaultdict(list) for m in modes}
    observe = controller.Controller.observe_round

    def timed(self, seconds, num_drafted, num_tested, num_accepted):
        times[current[0]][num_drafted].append(seconds)
        return observe(self, seconds, num_drafted, num_tested, num_accepted)

    controller.Controller.observe_round = timed
    prompts = [(d, p) for d in PROMPTS for p in PROMPTS[d][:2]]
    for m in modes:                                   # warm-up ("auto": its curve measured)
        current[0] = m
        md.generate(pair, prompts[0][1], max_tokens=16, num_draft=m, speculative=True)
    for m in modes:
        times[m].clear()
    cpu, tokens, rounds = collections.Counter(), collections.Counter(), collections.Counter()
    for _ in range(args.repeats):
        for domain, prompt in prompts:
            for m in modes:
                current[0] = m
                t0 = time.process_time()
                r = md.generate(pair, prompt, max_tokens=48, num_draft=m, speculative=True,
                                chat=domain != "code")
                cpu[m] += time.process_time() - t0
                tokens[m] += len(r.tokens)
                rounds[m] += r.stats["rounds"]
    for m in modes:
        per = {n: f"{len(v)} x {1e3 * statistics.median(v):.2f} ms"
               for n, v in sorted(times[m].items())}
        print(f"N={m}: {tokens[m] / cpu[m]:.1f} tok/s, {tokens[m] / rounds[m]:.2f} tokens/round, "
              f"rounds by length: {per}")
    curve = pair.drafter._auto_curve
    print("curve (serial steps) at load:", [round(c, 2) for c in curve.loaded],
          "at the end:", [round(c, 2) for c in curve.costs()])


if __name__ == "__main__":
    main()
