"""Issue 12's measurement: reproducible (coupled Gumbel) vs rejection sampling on the demo pair
and the bench prompts, in one run.

For each temperature x top-p, both schemes run ``mlx-dspark bench``'s measurement (serial,
forced speculation and auto, interleaved per prompt, medians over repeats). Reported per row:
tokens per round and tokens/s of forced speculation, the ratio reproducible / rejection of each,
and the speedup over serial the controller's cost model predicts on a GPU-like profile where a
round costs ``--gpu-round-cost`` serial steps (a verify of N+1 tokens about as cheap as one
step, plus the drafter): ``E / r`` with E the measured tokens per round.

    python benchmarks/bench_sampling.py [--max-tokens 64] [--repeats 2] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_sampling.py
"""

import argparse
import json
import sys

from mlx_dspark.cli.bench import PROMPTS, measure
from mlx_dspark.cli.common import load_pair

SCHEMES = ("reproducible", "rejection")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--top-ps", default="0.95,1.0")
    ap.add_argument("--gpu-round-cost", type=float, default=1.25,
                    help="round cost in serial steps on the GPU-like profile (default 1.25)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    base = dict(model=None, drafter=None, dtype=None, verify="auto", no_memory_check=False,
                speculative="auto", top_k=0, max_tokens=a.max_tokens, num_draft=a.num_draft,
                repeats=a.repeats)
    pair = load_pair(argparse.Namespace(**base, temp=0.0, top_p=1.0, sampling=SCHEMES[0]))
    prompts = [(d, p) for d in PROMPTS for p in PROMPTS[d]]
    rows = []
    for t in map(float, a.temps.split(",")):
        for top_p in map(float, a.top_ps.split(",")):
            r = {}
            for scheme in SCHEMES:
                args = argparse.Namespace(**base, temp=t, top_p=top_p, sampling=scheme)
                o = measure(pair, prompts, args)["overall"]
                r[scheme] = {"tokens_per_round": o["mean_tokens_per_round"],
                             "spec_tokens_per_s": o["tokens_per_s"]["speculative"],
                             "serial_tokens_per_s": o["tokens_per_s"]["serial"],
                             "auto_tokens_per_s": o["tokens_per_s"]["auto"],
                             "same_tokens": f"{o['same_tokens']}/{o['prompts']}",
                             "gpu_predicted_speedup": o["mean_tokens_per_round"]
                             / a.gpu_round_cost}
            rows.append({"temperature": t, "top_p": top_p, **r})
            print(f"T={t} top-p={top_p} done", file=sys.stderr)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| T | top-p | scheme | tokens/round | spec tok/s | serial tok/s | auto tok/s "
          "| modes agree | GPU-like predicted speedup | tokens/round ratio | tok/s ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        rep, rej = row["reproducible"], row["rejection"]
        for scheme in SCHEMES:
            s = row[scheme]
            ratio = (f"{rep['tokens_per_round'] / rej['tokens_per_round']:.3f} | "
                     f"{rep['spec_tokens_per_s'] / rej['spec_tokens_per_s']:.3f}"
                     if scheme == "reproducible" else " | ")
            print(f"| {row['temperature']:g} | {row['top_p']:g} | {scheme} | "
                  f"{s['tokens_per_round']:.2f} | {s['spec_tokens_per_s']:.1f} | "
                  f"{s['serial_tokens_per_s']:.1f} | {s['auto_tokens_per_s']:.1f} | "
                  f"{s['same_tokens']} | {s['gpu_predicted_speedup']:.2f}x | {ratio} |")


if __name__ == "__main__":
    main()
