"""Drafter cost per round against one target decode step, at the real dimensions.

    python benchmarks/bench_drafter.py [--dtype bf16|fp32] [--nvfp4 quantized|dequantized]

The drafter is NVIDIA's DSpark shape (hidden 2688, 6 layers, 32/2 heads x 128, MLP 6144,
vocab 131072, Markov rank 512; fc, MLP and markov_w2 NVFP4, the rest BF16) with random
weights. The target is a real-width Nemotron-H slice built from mlx_dspark.models.nemotron_h's classes
with random weights: one Mamba-2, one MoE and one attention block (Nemotron 3 Nano 30B-A3B
sizes: Mamba 64x64 heads, state 128, 8 groups; 128 experts of 1856, top 6, shared expert
3712; attention 32/2 x 128; NVFP4 Mamba projections and experts, BF16 attention, embedding
and lm_head). Each block's decode-step time is measured alone, and the full 52-layer step is
estimated as the pattern's count of each kind times its time, plus final norm and lm_head:

    c(N) = t_draft(N) / t_target_step      (docs/design.md §8)

Random weights make the timings real and the tokens meaningless. Medians of a few repeats
after a warm-up, ``mx.eval`` before every clock read. Peak memory is a few GB.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import mlx.core as mx

from mlx_dspark.drafters.dspark import DSparkDrafter
from mlx_dspark.drafters.config import parse_config
from mlx_dspark.models.nemotron_h import NemotronH, TargetConfig

PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # docs/design.md §5
H, V = 2688, 131072

TARGET = dict(
    vocab_size=V, hidden_size=H, hybrid_override_pattern="ME*", layer_norm_epsilon=1e-5,
    num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
    n_routed_experts=128, num_experts_per_tok=6, routed_scaling_factor=2.5,
)

DRAFTER = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": H,
    "intermediate_size": 6144, "num_hidden_layers": 6, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "vocab_size": V, "layer_types": ["sliding_attention"] * 6, "sliding_window": 1024,
    "attention_sink_bias": True, "block_size": 8, "mask_token_id": 990,
    "target_layer_ids": [1, 5, 19, 29, 41, 51],
    "dflash_config": {"causal": True, "use_swa": True},
    "dspark_bonus_anchor": True, "sample_from_anchor": False,
    "dspark_fixup_head_type": "markov", "markov_head_type": "vanilla", "markov_rank": 512,
}


def tiled(make, shape) -> mx.array:
    """A random tensor of ``shape`` made of one random ``(<=256, cols)`` block repeated down
    the rows (and across a leading expert axis): generating GBs of random numbers would
    dominate the run, and the values do not change the timings."""
    rows = min(shape[-2], 256)
    block = make((rows, shape[-1]))
    reps = -(-shape[-2] // rows)
    full = mx.tile(block, (reps, 1))[:shape[-2]]
    return mx.broadcast_to(full, shape) + mx.zeros(shape, full.dtype) if len(shape) > 2 else full


def nvfp4(w: dict, prefix: str, out: int, inp: int, lead=()):
    """Random packed NVFP4 (codes, E4M3 block scales in [0.5, 1), a tensor scale that keeps
    outputs O(1)): the converted layout, without paying for a quantizer."""
    shape = (*lead, out)
    w[f"{prefix}.weight"] = tiled(lambda s: mx.random.randint(-2**31, 2**31 - 1, s).view(mx.uint32),
                                  (*shape, inp // 8))
    w[f"{prefix}.scales"] = tiled(lambda s: mx.random.randint(0x30, 0x38, s).astype(mx.uint8),
                                  (*shape, inp // 16))
    w[f"{prefix}.weight_scale_2"] = mx.full(lead, 1 / (2.1 * math.sqrt(inp)), mx.float32)


def dense(w: dict, prefix: str, out: int, inp: int):
    w[f"{prefix}.weight"] = tiled(lambda s: (mx.random.normal(s) * inp ** -0.5).astype(mx.bfloat16),
                                  (out, inp))


def norm(shape):
    return (1 + 0.1 * mx.random.normal(shape)).astype(mx.bfloat16)


def target_weights() -> dict:
    c = TARGET
    w = {"backbone.embeddings.weight": tiled(lambda s: mx.random.normal(s).astype(mx.bfloat16), (V, H)),
         "backbone.norm_f.weight": norm((H,))}
    dense(w, "lm_head", V, H)
    d_in = c["mamba_num_heads"] * c["mamba_head_dim"]
    conv = d_in + 2 * c["n_groups"] * c["ssm_state_size"]
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}"
        w[f"{p}.norm.weight"] = norm((H,))
        m = f"{p}.mixer"
        if kind == "M":
            nvfp4(w, f"{m}.in_proj", d_in + conv + c["mamba_num_heads"], H)
            nvfp4(w, f"{m}.out_proj", H, d_in)
            w[f"{m}.conv1d.weight"] = 0.5 * mx.random.normal((conv, 1, c["conv_kernel"]))
            w[f"{m}.conv1d.bias"] = 0.1 * mx.random.normal((conv,))
            w[f"{m}.dt_bias"] = mx.random.normal((c["mamba_num_heads"],))
            w[f"{m}.A_log"] = mx.log(mx.random.uniform(1, 16, (c["mamba_num_heads"],)))
            w[f"{m}.D"] = mx.random.normal((c["mamba_num_heads"],))
            w[f"{m}.norm.weight"] = norm((d_in,))
        elif kind == "E":
            e, f, s = c["n_routed_experts"], c["moe_intermediate_size"], \
                c["moe_shared_expert_intermediate_size"]
            w[f"{m}.gate.weight"] = mx.random.normal((e, H)) * H ** -0.5
            w[f"{m}.gate.e_score_correction_bias"] = 0.1 * mx.random.normal((e,))
            nvfp4(w, f"{m}.experts.up_proj", f, H, (e,))
            nvfp4(w, f"{m}.experts.down_proj", H, f, (e,))
            nvfp4(w, f"{m}.shared_experts.up_proj", s, H)
            nvfp4(w, f"{m}.shared_experts.down_proj", H, s)
        else:
            nh, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            for n, out, inp in (("q_proj", nh * hd, H), ("k_proj", kv * hd, H),
                                ("v_proj", kv * hd, H), ("o_proj", H, nh * hd)):
                dense(w, f"{m}.{n}", out, inp)
    return w


def drafter_weights(cfg) -> dict:
    w = {"hidden_norm.weight": norm((H,)), "norm.weight": norm((H,)),
         "markov_head.markov_w1.weight": tiled(lambda s: mx.random.normal(s).astype(mx.bfloat16),
                                               (V, cfg.markov_rank))}
    nvfp4(w, "fc", H, H * len(cfg.target_layer_ids))
    nvfp4(w, "markov_head.markov_w2", V, cfg.markov_rank)
    hd, i = cfg.head_dim, cfg.intermediate_size
    for l in range(cfg.num_layers):
        p = f"layers.{l}"
        w[f"{p}.input_layernorm.weight"] = norm((H,))
        w[f"{p}.post_attention_layernorm.weight"] = norm((H,))
        w[f"{p}.self_attn.q_norm.weight"] = norm((hd,))
        w[f"{p}.self_attn.k_norm.weight"] = norm((hd,))
        w[f"{p}.self_attn.attention_sink_bias"] = mx.random.normal((cfg.num_heads,)).astype(mx.bfloat16)
        for n, out, inp in (("q_proj", cfg.num_heads * hd, H), ("k_proj", cfg.num_kv_heads * hd, H),
                            ("v_proj", cfg.num_kv_heads * hd, H), ("o_proj", H, cfg.num_heads * hd)):
            dense(w, f"{p}.self_attn.{n}", out, inp)
        nvfp4(w, f"{p}.mlp.gate_proj", i, H)
        nvfp4(w, f"{p}.mlp.up_proj", i, H)
        nvfp4(w, f"{p}.mlp.down_proj", H, i)
    return w


def median_time(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--nvfp4", choices=["quantized", "dequantized"], default=None,
                    help="NVFP4 compute path (default: quant.nvfp4_policy for this backend)")
    ap.add_argument("--context", type=int, default=16, help="context tokens before timing")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = {"bf16": mx.bfloat16, "fp32": mx.float32}[args.dtype]
    mx.random.seed(0)

    log("building the target slice")
    target = NemotronH(TargetConfig.from_dict(TARGET), target_weights(), dtype, args.nvfp4)
    mx.eval(target.parameters())
    cache = target.make_cache()
    prompt = mx.random.randint(0, V, (1, args.context))
    mx.eval(target.step(prompt, cache)[0])

    log("timing the target")
    # One decode step, block by block (each advances its own cache by one token per call).
    x = target.embed(mx.array([[5]]))
    per_kind = {}
    reps = max(9, args.repeats)  # cheap, and the most leveraged numbers (x23 for M and E)
    for i, layer in enumerate(target.layers):
        per_kind[layer.kind] = median_time(lambda: layer(x, cache[i], False), reps)
    head = median_time(lambda: target.lm_head(mx.fast.rms_norm(x, target.norm_f, 1e-5)), reps)
    slice_step = median_time(lambda: target.step(mx.array([[7]]), cache)[0], args.repeats)
    full_step = head + sum(PATTERN.count(k) * t for k, t in per_kind.items())

    log("building the drafter")
    cfg = parse_config(DRAFTER)
    drafter = DSparkDrafter(cfg, drafter_weights(cfg), target, dtype, share_embedding=True,
                            nvfp4=args.nvfp4)
    mx.eval(drafter.parameters())
    context = drafter.make_cache()       # the drafter's context, as a decoding session holds it
    drafter.add_context(mx.random.normal((args.context, H * 6)).astype(dtype), 0, context)
    markov = median_time(lambda: drafter.markov_head(mx.array([11])), args.repeats)
    rows = []
    for n in range(1, 8):
        log(f"timing the drafter, N={n}")
        rows.append((n, median_time(lambda: drafter.propose(11, n, cache=context),
                                    args.repeats)))

    print(f"dtype {args.dtype}, nvfp4 {args.nvfp4 or 'default policy'}, context {args.context}, "
          f"median of {args.repeats}")
    print("target decode step, per block: " + ", ".join(
        f"{k} {t * 1e3:.1f} ms" for k, t in per_kind.items()) + f", norm+lm_head {head * 1e3:.1f} ms")
    print(f"target slice ({TARGET['hybrid_override_pattern']}) step {slice_step * 1e3:.1f} ms "
          f"(sum of its parts {(head + sum(per_kind.values())) * 1e3:.1f} ms); "
          f"full {len(PATTERN)}-layer step estimated {full_step * 1e3:.1f} ms")
    print(f"drafter Markov step (W2 W1[prev], 512 -> {V}): {markov * 1e3:.1f} ms, N of them per round")
    print(f"{'N':>2} {'draft ms':>9} {'c = draft/step':>15}")
    for n, t_round in rows:
        print(f"{n:>2} {t_round * 1e3:9.1f} {t_round / full_step:15.3f}")


if __name__ == "__main__":
    main()
