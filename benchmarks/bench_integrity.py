"""Load-time cost of each integrity level (docs/integrity.md).

    python benchmarks/bench_integrity.py --gb 2.5 --work /tmp/integrity-bench

Builds a synthetic ModelOpt target whose embedding and lm_head are widened to about ``--gb``
GB (testkit.synthetic, random BF16 rows), converts it with ``mlx-dspark convert``, then
times, per level, the receipt check alone and the whole ``load_target`` (medians of
``--repeats`` after one warm-up load, so every run reads from the page cache). Deletes the
work directory at the end unless ``--keep``."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mlx_dspark.converter import convert
from mlx_dspark.checkpoint.integrity import receipt_outputs, verify_outputs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.synthetic import H, synth_target


def widen_vocab(rows: int):
    """A synthetic-target edit: embedding and lm_head of ``rows`` random BF16 rows each."""
    def edit(tensors, config, quant):
        rng = np.random.default_rng(0)
        for name in ("backbone.embeddings.weight", "lm_head.weight"):
            bits = rng.integers(0x3c00, 0x3d00, size=(rows, H), dtype=np.uint16)  # +-small
            tensors[name] = ("BF16", (rows, H), bits.astype("<u2").tobytes())
        config["vocab_size"] = rows
    return edit


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.5)
    p.add_argument("--work", default="/tmp/integrity-bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    import mlx.core as mx
    from mlx_dspark.models.nemotron_h import load_target

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    rows = int(args.gb * 1e9 / (2 * H * 2))
    t = time.perf_counter()
    synth_target(work / "src", edit=widen_vocab(rows))
    print(f"source written in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    out = convert(str(work / "src"), work / "out", progress=False)
    print(f"converted in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    shutil.rmtree(work / "src")
    outputs = receipt_outputs(out)
    size = sum(o.size for o in outputs)
    print(f"checkpoint: {size / 1e9:.2f} GB in {len(outputs)} files")

    def load(level):
        model = load_target(str(out), dtype=mx.bfloat16, verify=level)
        mx.eval(model.parameters())

    load("none")                                     # warm the page cache
    print("| level | check alone (s) | load_target (s) |")
    print("|---|---|---|")
    for level in ("none", "fast", "auto", "full"):
        check = (0.0 if level == "none"
                 else timed(lambda: verify_outputs(str(out), outputs, level), args.repeats))
        total = timed(lambda: load(level), args.repeats)
        print(f"| {level} | {check:.2f} | {total:.2f} |", flush=True)
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
