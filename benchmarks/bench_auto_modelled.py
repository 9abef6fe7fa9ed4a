"""``num_draft="auto"`` against every fixed length with each round priced by this machine's
measured cost curve (tests/fixtures/auto_curves.json) instead of the clock: exact and
repeatable, so it shows what the choice itself gains or loses, per drafter, BLAS build and
prompt domain (the bench's prompts, greedy). What tests/test_auto_bound.py asserts, in full:

    python benchmarks/bench_auto_modelled.py [--limit 2] [-m 48] [--drafters dspark,mtp]
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import json

from auto_curves import FIXTURE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=2, help="prompts per domain")
    ap.add_argument("-m", "--max-tokens", type=int, default=48)
    ap.add_argument("--drafters", default="dspark,mtp,eagle3,dflash")
    args = ap.parse_args()
    import mlx_dspark as md
    from mlx_dspark.cli.bench import PROMPTS, _ids
    from testkit.modelled import against_best, rates

    curves = json.loads(FIXTURE.read_text())
    builds = list(curves)            # stock, openblas: one curve per drafter each
    print("| drafter | build | domain | best fixed N | auto / best | auto / N=3 |")
    print("|---|---|---|---|---|---|")
    for name in args.drafters.split(","):
        pair = md.load(drafter=name)
        domains = {d: [_ids(pair, d, t) for t in PROMPTS[d][:args.limit]] for d in PROMPTS}
        domains["all"] = [p for d in PROMPTS for p in domains[d]]
        for domain, prompts in domains.items():
            got = rates(pair, prompts, {b: curves[b][name] for b in builds},
                        max_tokens=args.max_tokens)
            for b in builds:
                best, ratio = against_best(got[b])
                print(f"| {name} | {b} | {domain} | {best} | {ratio:.3f} "
                      f"| {got[b]['auto'] / got[b][3]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
