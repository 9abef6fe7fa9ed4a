"""The loop benchmark of issue 5: serial vs speculative vs auto, in the same run.

Cases: a useless drafter (DSpark layout, random weights), and the test oracle drafter at
acceptance 0.9 / 0.7 / 0.5 wrapped around that same random drafter, so every round pays a real
drafter's cost while acceptance is what we chose. Greedy, N = 3.

Target: the embedded demo target (``--demo``, when it is installed) or, by default, a random
target of the demo's shape (Nemotron-H "MEM*EM", hidden 192, vocab 4096; fp32).

    python benchmarks/bench_loop.py [--demo] [--tokens 64] [--repeats 3] [--only NAME] [--fresh-auto] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_loop.py
"""

from pathlib import Path
import argparse
import json
import os
import sys

import mlx.core as mx

from mlx_dspark.cli.measure import format_rows
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.compare import compare
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter, tiny_target

DEMO_SHAPE = dict(pattern="MEM*EM", vocab_size=4096, hidden_size=192, intermediate_size=256,
                  moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
                  n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=48, mamba_num_heads=6, mamba_head_dim=32,
                  ssm_state_size=32)


CODE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
                "class Stack:\n    def __init__(self):"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", action="store_true", help="use the embedded demo target")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--fresh-auto", action="store_true",
                    help="auto starts every call from nothing (a one-shot process's first call) "
                         "instead of from what earlier calls with the drafter learned")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    pair = None
    if args.demo:
        import mlx_dspark as md
        pair = md.load()
        target, label = pair.target, "demo pair (a demonstration model, not Nemotron)"
    else:
        target, label = tiny_target(seed=0, **DEMO_SHAPE), "random demo-shaped target (fp32)"
    vocab = target.config.vocab_size
    taps = (1, 3, len(target.config.hybrid_override_pattern) - 1)
    useless = random_drafter(target, layers=2, window=256, tap_layers=taps)
    if pair is not None:     # code completions, where the demo drafter was trained to shine
        prompts = [pair.tokenizer.encode(t) for t in CODE_PROMPTS[:args.prompts]]
    else:
        prompts = [[(37 * i + 11 * k) % (vocab - 2) + 1 for i in range(24 + 40 * k)]
                   for k in range(args.prompts)]

    cases = {"useless drafter (random weights)": lambda p, ref: useless}
    if pair is not None:
        cases["demo drafter (trained)"] = lambda p, ref: pair.drafter
    for alpha in (0.9, 0.7, 0.5):
        cases[f"oracle, acceptance {alpha}"] = (
            lambda p, ref, a=alpha: OracleDrafter(ref, vocab, a, inner=useless, seed=1))
    results = {}
    for name, make in cases.items():
        if args.only and args.only not in name:
            continue
        results[name] = compare(target, make, prompts, max_tokens=args.tokens,
                                repeats=args.repeats, fresh_auto=args.fresh_auto)
        print(f"  done: {name}", file=sys.stderr)
    blas = os.environ.get("LD_PRELOAD", "") or "MLX's bundled BLAS"
    if args.json:
        print(json.dumps({"target": label, "blas": blas, "results": results}, indent=1))
    else:
        learned = "auto from nothing each call" if args.fresh_auto else "auto keeps what it learned"
        print(f"{label}; {blas}; greedy, N=3, {args.tokens} tokens x {len(prompts)} prompts, "
              f"median of {args.repeats} after warm-up; {learned}; mlx {mx.__version__}")
        print(format_rows(results))


if __name__ == "__main__":
    main()
