"""The formats table of docs/formats.md: the demo target in every layout that loads, each
loaded by mlx-dspark and (where it can) by mlx-lm, at float32.

The NVFP4 original is the embedded demo target (NVIDIA's W4A16 NVFP4 layout converted by
``mlx-dspark convert``). Its weights, dequantized exactly, make a plain Hugging Face directory
in float32 (with the MTP block); ``mlx_lm.convert`` turns that into each of
``testkit.mlx_lm_layouts.FORMATS``. Per format: whether it loads, the largest
logit difference from mlx-lm's ``nemotron_h`` on the same files (relative to the largest
logit; the original is compared with mlx-lm on its dequantized copy), whether greedy decoding
gives mlx-lm's tokens, and the demo DSpark drafter's tokens per round against it (greedy,
``--num-draft 3``, the built-in code prompts of ``mlx-dspark bench`` and four more, 128
tokens each), with "lossless" checking speculative == serial. The drafter was trained on
the original: its tokens per round on a quantized copy is what quantization costs speculation.

    python benchmarks/bench_formats.py [--tokens 128] [--out DIR] [--formats NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

import mlx_dspark as md
from mlx_dspark.api import DEMO
from mlx_dspark.cli.bench import PROMPTS as BENCH_PROMPTS
from mlx_dspark.open_files import import_mlx_lm
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.mlx_lm_layouts import make_all

PROMPTS = [*BENCH_PROMPTS["code"], "import os\n\n\ndef read_lines(path):",
           "def parse_args(argv):\n    parser = ", "class Config:\n    def __init__(self, path):\n",
           "def merge_sorted(a, b):\n"]


def mlx_lm_greedy(model, ids: list[int], n: int) -> list[int]:
    """mlx-lm's model decoding greedily with its own cache."""
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def measure(name: str, path: Path, oracle: Path, tokens: int) -> dict:
    utils = import_mlx_lm("mlx_lm.utils")
    row = {"format": name, "path": str(path)}
    try:
        pair = md.load(str(path), str(DEMO / "drafter"), dtype="float32", warm=False)
    except Exception as e:        # the table says what does not load, and why
        return {**row, "loads": False, "why": " ".join(str(e).split())}
    ref, _ = utils.load_model(oracle)
    ref.set_dtype(mx.float32)
    row.update(loads=True, layout=str(pair.target.format))
    errors, same, lossless, rounds, emitted = [], True, True, 0, 0
    for prompt in PROMPTS:
        ids = pair.tokenizer.encode(prompt)
        ours, theirs = pair.target(mx.array([ids])), ref(mx.array([ids]))
        errors.append((mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item())
        serial = md.generate(pair, ids, max_tokens=tokens, speculative="off")
        spec = md.generate(pair, ids, max_tokens=tokens, speculative="on", num_draft=3)
        same &= serial.tokens == mlx_lm_greedy(ref, ids, tokens)
        lossless &= spec.tokens == serial.tokens
        rounds += spec.stats.rounds
        emitted += spec.stats.mean_tokens_per_round * spec.stats.rounds
    row.update(logit_error=max(errors), greedy_equal=same, lossless=lossless,
               tokens_per_round=emitted / rounds)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", help="where the converted copies go (default: a temporary dir)")
    ap.add_argument("--formats", nargs="+", metavar="NAME", help="only these of FORMATS")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-formats-"))
    made = make_all(out, DEMO / "target", args.formats)
    rows = [measure("nvfp4 original (mlx-dspark)", DEMO / "target", made["hf-fp32"], args.tokens)]
    rows += [measure(name, path, path, args.tokens) for name, path in made.items()]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return
    print("| format | loads | logit error vs mlx-lm | greedy equal | DSpark tokens/round "
          "(lossless) |\n|---|---|---|---|---|")
    for r in rows:
        if not r["loads"]:
            print(f"| {r['format']} | no: {r['why']} | | | |")
            continue
        print(f"| {r['format']} | yes | {r['logit_error']:.1e} | "
              f"{'yes' if r['greedy_equal'] else 'no'} | {r['tokens_per_round']:.2f} "
              f"({'yes' if r['lossless'] else 'NO'}) |")


if __name__ == "__main__":
    main()
