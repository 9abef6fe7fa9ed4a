"""Measure each demo drafter's round-cost curve on this machine (a round of 1..7 drafts, in
serial steps: decode/costs.py's calibration, the median of three) and store it under a name in
tests/fixtures/auto_curves.json, which tests/test_auto_bound.py and bench_auto_modelled.py price
rounds on. Run once per BLAS build:

    python benchmarks/auto_curves.py stock
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/auto_curves.py openblas
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "auto_curves.json"
DRAFTERS = ("dspark", "mtp", "eagle3", "dflash")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name", help="what the curves are stored as: stock, openblas")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import mlx_dspark as md
    from mlx_dspark.decode import costs
    from mlx_dspark.policy.length import median

    curves = {}
    for name in DRAFTERS:
        pair = md.load(drafter=name)
        runs = [costs.calibrate(pair.target, pair.drafter, repeats=5)[1]
                for _ in range(args.runs)]
        curves[name] = [round(median(list(at)), 3) for at in zip(*runs)]
        print(name, curves[name], flush=True)
    stored = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    stored[args.name] = dict(curves, machine=f"{platform.machine()}, {os.cpu_count()} cores, "
                             f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    FIXTURE.write_text(json.dumps(stored, indent=1) + "\n")


if __name__ == "__main__":
    main()
