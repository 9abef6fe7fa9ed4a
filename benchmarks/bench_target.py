"""Target benchmarks (issue 3), all on random weights in the converted layout:

  (a) serial greedy decode tokens/s, our target vs mlx-lm's own ``generate_step`` on the same
      weights (BF16, and NVFP4 with tensor scale 1 so mlx-lm computes the same function);
  (b) verify cost: an (N+1)-token verify vs a 1-token step, N = 1..7, plus what the same
      block costs through the chunked SSM scan instead of the serial recurrence;
  (c) rollback cost: commit(a+1 of N+1) (snapshot restore + recurrence replay) as a share of
      the verify round, on a model with the real Nemotron widths and only a few layers.

    python benchmarks/bench_target.py [--part a b c] [--dtype bfloat16|float32]
        [--nvfp4 quantized|dequantized] [--reps 5]

Timings: warm-up first, ``mx.eval`` before reading the clock, medians. On Linux the CPU BLAS
matters: run once as is and once with
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3`` (docs/design.md §10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models import nemotron_h as T
from mlx_dspark.device import on_gpu
from mlx_dspark.models.quant import NVFP4_POLICY
from mlx_dspark.models.nemotron_h import NemotronH, TargetConfig

# hidden 2688, 64x64 Mamba heads, state 128, 128 experts top-6 (Nemotron 3 30B-A3B widths)
REAL = dict(vocab_size=131072, hidden_size=2688, num_attention_heads=32,
            num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
            ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
            intermediate_size=1856, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, n_routed_experts=128,
            num_experts_per_tok=6, routed_scaling_factor=2.5, n_group=1, topk_group=1,
            norm_topk_prob=True, layer_norm_epsilon=1e-5, hybrid_override_pattern="MEM*EM")
# a mid-size model both implementations decode in reasonable time on two CPU cores
MID = dict(REAL, vocab_size=32000, hidden_size=1024, num_attention_heads=8, head_dim=128,
           mamba_num_heads=32, mamba_head_dim=32, ssm_state_size=64, n_groups=4,
           moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024,
           n_routed_experts=32, intermediate_size=1024, hybrid_override_pattern="MEM*EM-E")
MLX_LM_EXTRA = dict(model_type="nemotron_h", max_position_embeddings=8192,
                    attention_bias=False, mamba_proj_bias=False, mlp_bias=False,
                    use_bias=False, use_conv_bias=True, n_shared_experts=1)


def linear_shapes(cfg: dict):
    """(prefix, leading shape, out, in) of every projection, HF names, experts stacked."""
    h, pat = cfg["hidden_size"], cfg["hybrid_override_pattern"]
    d_in = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    conv = d_in + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    hd = cfg["head_dim"]
    for i, c in enumerate(pat):
        p = f"backbone.layers.{i}.mixer"
        if c == "M":
            yield f"{p}.in_proj", (), d_in + conv + cfg["mamba_num_heads"], h
            yield f"{p}.out_proj", (), h, d_in
        elif c == "*":
            yield f"{p}.q_proj", (), cfg["num_attention_heads"] * hd, h
            yield f"{p}.k_proj", (), cfg["num_key_value_heads"] * hd, h
            yield f"{p}.v_proj", (), cfg["num_key_value_heads"] * hd, h
            yield f"{p}.o_proj", (), h, cfg["num_attention_heads"] * hd
        elif c == "E":
            e, m, s = (cfg["n_routed_experts"], cfg["moe_intermediate_size"],
                       cfg["moe_shared_expert_intermediate_size"])
            yield f"{p}.experts.up_proj", (e,), m, h
            yield f"{p}.experts.down_proj", (e,), h, m
            yield f"{p}.shared_experts.up_proj", (), s, h
            yield f"{p}.shared_experts.down_proj", (), h, s
        else:
            yield f"{p}.up_proj", (), cfg["intermediate_size"], h
            yield f"{p}.down_proj", (), h, cfg["intermediate_size"]


def random_checkpoint(cfg: dict, nvfp4: bool, seed=0) -> dict:
    """Converted-layout tensors drawn directly as bytes (no float model to quantize):
    NVFP4 codes uniform, E4M3 block scales around 0.4/sqrt(in), tensor scale 1.0 (so that
    mlx-lm, which has no tensor scale, computes the same function); or the BF16 weights
    those bytes decode to. Everything else (embeddings, norms, router, conv, lm_head) BF16."""
    mx.random.seed(seed)
    h, pat = cfg["hidden_size"], cfg["hybrid_override_pattern"]
    w = {}
    for p, lead, o, i in linear_shapes(cfg):
        half = (*lead, o, i // 8)
        q = mx.random.randint(0, 1 << 16, half).astype(mx.uint32) << 16 \
            | mx.random.randint(0, 1 << 16, half).astype(mx.uint32)
        s = mx.to_fp8(mx.random.uniform(0.3, 0.5, (*lead, o, i // 16)) * i ** -0.5)
        if nvfp4:
            w[f"{p}.weight"], w[f"{p}.scales"] = q, s
            w[f"{p}.weight_scale_2"] = mx.ones(lead, dtype=mx.float32)
        else:
            w[f"{p}.weight"] = mx.dequantize(q, s, group_size=16, bits=4, mode="nvfp4",
                                             dtype=mx.bfloat16)
        mx.eval(w)
    nh = cfg["mamba_num_heads"]
    conv = nh * cfg["mamba_head_dim"] + 2 * cfg["n_groups"] * cfg["ssm_state_size"]

    def rnd(shape, scale=1.0, shift=0.0):
        return (shift + scale * mx.random.normal(shape)).astype(mx.bfloat16)

    w["backbone.embeddings.weight"] = rnd((cfg["vocab_size"], h))
    w["lm_head.weight"] = rnd((cfg["vocab_size"], h), h ** -0.5)
    w["backbone.norm_f.weight"] = rnd((h,), 0.1, 1.0)
    for i, c in enumerate(pat):
        p = f"backbone.layers.{i}"
        w[f"{p}.norm.weight"] = rnd((h,), 0.1, 1.0)
        if c == "M":
            w[f"{p}.mixer.conv1d.weight"] = rnd((conv, 1, cfg["conv_kernel"]), 0.5)
            w[f"{p}.mixer.conv1d.bias"] = rnd((conv,), 0.1)
            w[f"{p}.mixer.dt_bias"] = rnd((nh,), 1.0, -3.0)
            w[f"{p}.mixer.A_log"] = mx.log(mx.random.uniform(1, 16, (nh,)))
            w[f"{p}.mixer.D"] = rnd((nh,))
            w[f"{p}.mixer.norm.weight"] = rnd((nh * cfg["mamba_head_dim"],), 0.1, 1.0)
        elif c == "E":
            w[f"{p}.mixer.gate.weight"] = mx.random.normal((cfg["n_routed_experts"], h)) \
                * h ** -0.5
            w[f"{p}.mixer.gate.e_score_correction_bias"] = \
                0.1 * mx.random.normal((cfg["n_routed_experts"],))
    mx.eval(w)
    return w


def mlx_lm_model(cfg: dict, w: dict, nvfp4: bool, dtype):
    from mlx_lm.models import nemotron_h as nh
    model = nh.Model(nh.ModelArgs.from_dict(dict(cfg, **MLX_LM_EXTRA)))
    if nvfp4:
        quantized = {p.replace(".experts.up_proj", ".switch_mlp.fc1")
                     .replace(".experts.down_proj", ".switch_mlp.fc2")
                     for p, *_ in linear_shapes(cfg)}
        nn.quantize(model, group_size=16, bits=4, mode="nvfp4",
                    class_predicate=lambda p, m: p in quantized)
    lm = {}
    for k, v in w.items():
        if k.endswith("weight_scale_2"):
            continue                                     # 1.0: nothing to apply
        k = k.replace(".experts.up_proj", ".switch_mlp.fc1") \
            .replace(".experts.down_proj", ".switch_mlp.fc2")
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)
        if v.dtype in (mx.float32, mx.bfloat16) and \
                not k.endswith(("e_score_correction_bias", "A_log")):
            v = v.astype(dtype)                # what mlx-lm's loader does (cast_predicate)
        lm[k] = v
    model.load_weights(list(lm.items()))
    mx.eval(model.parameters())
    return model


def timed(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def ours_decoder(model, prompt):
    """Greedy decoding pipelined like mlx-lm's generate_step (the next step's graph is built
    while the current one computes); yields once per token."""
    cache = model.make_cache()
    logits, _ = model.step(prompt, cache)
    y = logits[:, -1].argmax(-1)
    mx.async_eval(y)
    while True:
        logits, _ = model.step(y[:, None], cache)
        nxt = logits[:, -1].argmax(-1)
        mx.async_eval(nxt)
        yield y.item()
        y = nxt


def decode_rates(ours, ref, prompt, blocks, block=6):
    """Tokens/s of both decoders, measured in alternating blocks of ``block`` tokens so that
    load drift on a shared machine hits both alike; the first step of every block (which
    overlaps the other decoder's in-flight step) is not counted."""
    from mlx_lm.generate import generate_step
    gens = [ours_decoder(ours, prompt),
            (tok for tok, _ in generate_step(prompt[0], ref, max_tokens=10**6))]
    times = [[], []]
    for _ in range(blocks):
        for g, out in zip(gens, times):
            t = time.perf_counter()
            for i in range(block + 1):
                next(g)
                now = time.perf_counter()
                if i:
                    out.append(now - t)
                t = now
    return [1.0 / statistics.median(t) for t in times]


def part_a(args):
    print("\n(a) serial greedy decode, mid-size model "
          f"(hidden {MID['hidden_size']}, {MID['n_routed_experts']} experts top-6, "
          f"pattern {MID['hybrid_override_pattern']}), 16-token prompt, "
          f"median step over {args.blocks} alternating blocks of 6 tokens")
    print(f"| weights | ours tok/s ({args.dtype}, nvfp4={args.nvfp4 or 'default'}) "
          "| mlx-lm tok/s | ratio |")
    print("|---|---|---|---|")
    # mlx-lm runs in bf16 where it can; MLX's CPU gather_mm (its dense MoE) is fp32-only,
    # so on the CPU its bf16-weight model has to compute in fp32.
    dense_dtype = mx.bfloat16 if on_gpu() else mx.float32
    prompt = mx.random.randint(0, MID["vocab_size"], (1, 16))
    for fmt in ("bf16", "nvfp4"):
        w = random_checkpoint(MID, fmt == "nvfp4")
        ours = NemotronH(TargetConfig.from_dict(MID), w, args.dtype, args.nvfp4)
        ref_dtype = mx.bfloat16 if fmt == "nvfp4" else dense_dtype
        ref = mlx_lm_model(MID, w, fmt == "nvfp4", ref_dtype)
        a = ours(prompt[:, :12]).astype(mx.float32)
        b = ref(prompt[:, :12]).astype(mx.float32)
        agree = (a.argmax(-1) == b.argmax(-1)).mean().item()
        r_ours, r_ref = decode_rates(ours, ref, prompt, args.blocks)
        print(f"| {fmt} | {r_ours:.2f} | {r_ref:.2f} ({ref_dtype}) | {r_ours / r_ref:.2f}x "
              f"(argmax agreement {agree:.0%}) |")
        del ours, ref, w


def real_width_model(args):
    cfg = dict(REAL, vocab_size=args.vocab)
    w = random_checkpoint(cfg, nvfp4=True)
    model = NemotronH(TargetConfig.from_dict(cfg), w, args.dtype, args.nvfp4)
    mx.eval(model.parameters())
    return model


def part_bc(args, model):
    cfg = model.config
    ctx = mx.random.randint(0, cfg.vocab_size, (1, 64))
    cache = model.make_cache()
    mx.eval(model.step(ctx, cache)[0])
    mamba = [c for c in cache.layers if isinstance(c, T.MambaCache)]
    snap = [(c.conv, c.ssm) for c in mamba]

    def states():
        return [(c.conv, c.ssm) for c in mamba]

    def reset(n):
        """Back to the 64-token context: drop n positions of KV, restore the Mamba states
        (so every measurement starts from the same cache)."""
        for c in cache.layers:
            if isinstance(c, T.KVCache):
                c.offset -= n
        cache.offset -= n
        for c, (conv, ssm) in zip(mamba, snap):
            c.conv, c.ssm = conv, ssm

    def clock(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def step1():
        logits, _ = model.step(ctx[:, :1], cache)
        mx.eval(logits, states())

    step1()
    reset(1)
    t1 = []
    for _ in range(args.reps):
        t1.append(clock(step1))
        reset(1)
    t1 = statistics.median(t1)
    print(f"\n(b) verify cost vs a 1-token step ({1e3 * t1:.0f} ms); (c) rollback = commit "
          f"of a+1 of N+1 positions (restore + replay). Real widths (hidden {cfg.hidden_size},"
          f" {cfg.mamba_num_heads}x{cfg.mamba_head_dim} Mamba heads, state "
          f"{cfg.ssm_state_size}, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, pattern "
          f"{cfg.hybrid_override_pattern}, context 64, dtype {model.dtype}")
    print("| N | verify (N+1 tok) ms | / step | same block, chunked scan ms "
          "| rollback a=0 ms | rollback a=N-1 ms | rollback share of round (a=N-1) |")
    print("|---|---|---|---|---|---|---|")
    for n in range(1, 8):
        toks = ctx[:, 1:n + 2]

        def verify():
            logits, _ = model.verify(toks, cache, tap_layers=(1, 5))
            mx.eval(logits, states())

        def chunked():
            saved, T.SERIAL_MAX = T.SERIAL_MAX, 0
            try:
                logits, _ = model.step(toks, cache)
                mx.eval(logits, states())
            finally:
                T.SERIAL_MAX = saved

        def commit(keep):
            model.commit(cache, keep)
            mx.eval(states())

        tv, tc, r0, r1 = [], [], [], []
        for rep in range(args.reps + 1):            # the first round is a warm-up
            for keep, out in ((1, r0), (n, r1)):
                v = clock(verify)
                r = clock(lambda: commit(keep))
                reset(keep)
                if rep:
                    tv.append(v)
                    out.append(r)
            c = clock(chunked)
            reset(n + 1)
            if rep:
                tc.append(c)
        tv, tc, r0, r1 = map(statistics.median, (tv, tc, r0, r1))
        print(f"| {n} | {1e3 * tv:.0f} | {tv / t1:.2f}x | {1e3 * tc:.0f} | {1e3 * r0:.1f} "
              f"| {1e3 * r1:.1f} | {100 * r1 / (tv + r1):.1f}% |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", default=["a", "b", "c"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="compute dtype (default: target.default_dtype())")
    ap.add_argument("--nvfp4", choices=["quantized", "dequantized"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192,
                    help="vocabulary of the real-width model (real: 131072; smaller keeps the "
                         "run short and only makes the verify round cheaper, i.e. the "
                         "rollback share larger)")
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args()
    args.dtype = getattr(mx, args.dtype) if args.dtype else T.default_dtype()
    print(f"mlx {mx.__version__}, device={mx.default_device()}, "
          f"default nvfp4 policy for linears={NVFP4_POLICY}")
    if "a" in args.part:
        part_a(args)
    if "b" in args.part or "c" in args.part:
        part_bc(args, real_width_model(args))


if __name__ == "__main__":
    main()
