"""Batch invariance of the demo target's forward (docs/batching.md): is each row of a batched
forward (``NemotronH.step_rows``, rows at different lengths) bitwise the same as that row's
forward alone? Teacher-forced, so every row sees the same tokens both ways: rows of B = 1..4
prompts of different lengths are prefilled alone, then decoded ``--steps`` serial steps
(1 token per row) and ``--steps`` verify blocks (4 tokens per row, each row committing its own
random count), alone and batched. Reports, per B and shape, the largest |logit difference| and
how many greedy argmaxes differ. First, op by op (``ops``): each kind of matmul and kernel the
forward runs, B rows at once against each row alone, and attention over a padded, masked KV
against the row's own keys.

    python benchmarks/batch_invariance.py [--steps 64]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/batch_invariance.py
"""

import argparse
import json
import random

import mlx.core as mx

import mlx_dspark as md

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):\n    with open(path) as f:",
           "class Stack:\n    def __init__(self):", "# sort a list of numbers\nxs = [3, 1, 2]\n"]


def ops(target, seed=0):
    """Largest |difference| of each op's B-row result from its rows computed alone."""
    mx.random.seed(seed)
    mamba, moe, attention = target.layers[0].mixer, target.layers[1].mixer, target.layers[3].mixer
    kinds = {"NVFP4 quantized_matmul (Mamba in_proj)": mamba.in_proj,
             "dense fp32 matmul (attention q_proj, from bf16)": attention.q_proj,
             "dense fp32 matmul (lm_head 192x4096)": target.lm_head,
             "MoE layer (router matmul, gather_qmm, shared NVFP4 expert)": moe,
             "Mamba-2 mixer (conv, ssm_step, gated norm, NVFP4 projections)":
                 lambda x: mamba(x, None, False)}
    out = {}
    for name, f in kinds.items():
        for t in (1, 4):
            for b in (2, 3, 4):
                x = mx.random.normal((b, t, target.config.hidden_size))
                together = f(x)
                worst = max(mx.abs(together[i:i + 1] - f(x[i:i + 1])).max().item()
                            for i in range(b))
                out[name, t] = max(out.get((name, t), 0.0), worst)
    h, hkv, d = 4, 2, 48
    for sinks in (None, mx.random.normal((h,))):
        name = "attention over padded KV (mask) vs own keys" + (", with sinks" if sinks
                                                                  is not None else "")
        for t in (1, 4):
            for length in (5, 37, 200, 300):
                for pad in (1, 7, 64, 256):
                    q = mx.random.normal((1, h, t, d))
                    k, v = mx.random.normal((2, 1, hkv, length, d))
                    own = mx.fast.scaled_dot_product_attention(
                        q, k, v, scale=d ** -0.5, mask="causal" if t > 1 else None, sinks=sinks)
                    zeros = mx.zeros((1, hkv, pad, d))
                    mask = mx.arange(length + pad)[None] <= mx.arange(length - t, length)[:, None]
                    padded = mx.fast.scaled_dot_product_attention(
                        q, mx.concatenate([k, zeros], 2), mx.concatenate([v, zeros], 2),
                        scale=d ** -0.5, mask=mask, sinks=sinks)
                    out[name, t] = max(out.get((name, t), 0.0),
                                       mx.abs(own - padded).max().item())
    return out


def measure(target, prompts, steps, block, seed=0):
    """Teacher-forced rows alone and batched: (max |diff|, argmax mismatches, argmaxes)."""
    rng = random.Random(seed)
    alone = [target.make_cache() for _ in prompts]
    batch = [target.make_cache() for _ in prompts]
    for p, a, b in zip(prompts, alone, batch):
        for c in (a, b):
            target.step(mx.array([p]), c)
    feed = [[p[-1]] * block for p in prompts]
    worst, differ, total = 0.0, 0, 0
    for _ in range(steps):
        tokens = mx.array(feed)
        rows = []
        for i, c in enumerate(alone):
            rows.append((target.verify if block > 1 else target.step)(tokens[i:i + 1], c)[0][0])
        together = target.step_rows(tokens, batch, verify=block > 1)[0]
        mx.eval(rows, together)
        for i, row in enumerate(rows):
            worst = max(worst, mx.abs(row - together[i]).max().item())
            differ += (row.argmax(-1) != together[i].argmax(-1)).sum().item()
            total += block
        keep = [rng.randint(1, block) for _ in prompts]
        if block > 1:
            for i, n in enumerate(keep):
                target.commit(alone[i], n)
                target.commit(batch[i], n)
        # the next block: the alone run's greedy tokens (both runs are fed the same)
        feed = [row.argmax(-1).tolist()[-block:] if block > 1 else [row.argmax(-1).item()]
                for row in rows]
    return worst, differ, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pair = md.load()
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    out = [dict(op=name, tokens_per_row=t, max_abs_diff=d)
           for (name, t), d in ops(pair.target).items()]
    if not args.json:
        for row in out:
            print(f"{row['op']}, T={row['tokens_per_row']}: max |diff| {row['max_abs_diff']:.3g}")
    for block in (1, 4):
        for b in range(1, 5):
            worst, differ, total = measure(pair.target, prompts[:b], args.steps, block)
            out.append(dict(batch=b, tokens_per_row=block, max_abs_logit_diff=worst,
                            argmax_differs=differ, positions=total))
            if not args.json:
                print(f"B={b} T={block}: max |logit diff| {worst:.3g}, greedy argmax differs "
                      f"at {differ} of {total} positions", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
