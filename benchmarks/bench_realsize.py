"""Real-size measurements on a converted Lightning-shaped checkpoint (docs/history/real-size.md).

    python -m testkit.synthetic SRC [--layers N --experts E]   # the synthetic export
    mlx-dspark convert SRC -o OUT
    python benchmarks/bench_realsize.py OUT load    [--dtype float32|bfloat16]
    python benchmarks/bench_realsize.py OUT prefill [--lengths 16 256 1024 ...]
    python benchmarks/bench_realsize.py OUT decode  [--reps 5 --drafts 1 3 7]  # with/without grouping
    python benchmarks/bench_realsize.py DIR experts [--tokens 2048] # bytes per verify, real text

Each part runs in a fresh child process so that its peak resident memory (``ru_maxrss``) is
its own. Timings: warm-up first, ``mx.eval`` before reading the clock, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from mlx_dspark.checkpoint.integrity import checkpoint_files

GIB = 1 << 30


def weight_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in checkpoint_files(path))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _load(path, dtype):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dspark.models.nemotron_h import load_target
    rss0 = peak_rss()
    t0 = time.perf_counter()
    model = load_target(path, dtype=getattr(mx, dtype))
    t = time.perf_counter() - t0
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return model, {"load_s": t, "param_bytes": params, "baseline_rss": rss0}


def part_load(a):
    _, r = _load(a.path, a.dtype)
    r.update(file_bytes=weight_bytes(a.path), peak_rss=peak_rss())
    r["peak_over_params"] = (r["peak_rss"] - r["baseline_rss"]) / r["param_bytes"]
    return r


def part_prefill(a):
    import mlx.core as mx
    model, r = _load(a.path, a.dtype)
    out = {"load": r, "lengths": {}}
    for n in a.lengths:
        toks = mx.random.randint(0, model.config.vocab_size, (1, n), key=mx.random.key(n))
        row = {}
        for last_only in (True, False):
            mx.eval(toks)
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            cache = model.make_cache()
            t0 = time.perf_counter()
            logits, _ = model.step(toks, cache, last_only=last_only)
            mx.eval(logits)
            t = time.perf_counter() - t0
            cache_bytes = sum(x.nbytes for c in cache.layers if c is not None
                              for x in ((c.conv, c.ssm) if hasattr(c, "ssm") else c.state()))
            row["last_only" if last_only else "all_rows"] = {
                "s": t, "peak_extra": mx.get_peak_memory() - base, "cache_bytes": cache_bytes}
            del cache, logits
        out["lengths"][n] = row
    out["peak_rss"] = peak_rss()
    return out


def _median_time(fn, reps):
    import mlx.core as mx
    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def part_decode(a):
    import mlx.core as mx

    from mlx_dspark.models.nemotron_h import MoE
    model, r = _load(a.path, a.dtype)
    cache = model.make_cache()
    toks = mx.random.randint(0, model.config.vocab_size, (1, 40), key=mx.random.key(0))
    mx.eval(model.step(toks[:, :32], cache, last_only=True)[0])

    def step():
        out = model.step(toks[:, 32:33], cache)[0]
        for c in cache.layers:             # stay at the same context: undo the step
            if c is not None and hasattr(c, "offset"):
                c.offset -= 1
        cache.offset -= 1
        return out

    def verify(n):
        def run():
            out = model.verify(toks[:, 32:33 + n], cache)[0]
            model.commit(cache, 1)
            for c in cache.layers:
                if c is not None and hasattr(c, "offset"):
                    c.offset -= 1
            cache.offset -= 1
            return out
        return run
    t1 = _median_time(step, a.reps)
    res = {"load": r, "step_s": t1, "verify_over_step": {}}
    for n in a.drafts:
        row = res["verify_over_step"][n] = {}
        for grouped, least in (("grouped", 2), ("ungrouped", 1 << 30)):
            MoE.sort_min_tokens = least
            row[grouped] = _median_time(verify(n), a.reps) / t1
        MoE.sort_min_tokens = None
    res["peak_rss"] = peak_rss()
    return res


def part_experts(a):
    """Weight bytes a verify of N+1 tokens reads, against a single step, from real routing:
    the model runs over real text (Python's own ``inspect`` source), and every window of
    N+1 consecutive positions stands for a verify whose drafts were right. Ungrouped, each
    (token, expert) pair reads its expert; grouped, each distinct expert is read once. Every
    other weight is read once per call; embedding rows are not counted."""
    import inspect

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from mlx_dspark.models import nemotron_h as T
    from mlx_dspark.text.tokenizer import load_tokenizer

    model = T.load_target(a.path, dtype=mx.float32)
    toks = load_tokenizer(a.path).encode(inspect.getsource(inspect))[:a.tokens]
    routes, real = [], T.MoE.route

    def spy(self, x):
        idx, w = real(self, x)
        routes.append(np.array(idx).reshape(-1, idx.shape[-1]))
        return idx, w
    T.MoE.route = spy
    mx.eval(model(mx.array([toks])))
    T.MoE.route = real

    def nbytes(m):
        return sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    moes = [layer.mixer for layer in model.layers if layer.kind == "E"]
    per_expert = [(nbytes(m.up) + nbytes(m.down)) / m.up.weight.shape[0] for m in moes]
    other = (nbytes(model) - model.embeddings.nbytes
             - sum(pe * m.up.weight.shape[0] for pe, m in zip(per_expert, moes)))
    k = model.config.num_experts_per_tok
    step = other + k * sum(per_expert)
    out = {"tokens": len(toks), "experts": moes[0].up.weight.shape[0], "top_k": k,
           "step_bytes": step, "verify_over_step": {}}
    for n in range(1, 8):
        t = n + 1
        unique = [np.mean([len(set(r[s:s + t].ravel())) for s in range(len(r) - t + 1)])
                  for r in routes]
        grouped = other + sum(u * pe for u, pe in zip(unique, per_expert))
        plain = other + t * k * sum(per_expert)
        out["verify_over_step"][n] = {"grouped": grouped / step, "ungrouped": plain / step,
                                      "distinct_experts_per_layer": float(np.mean(unique))}
    return out


PARTS = {"load": part_load, "prefill": part_prefill, "decode": part_decode,
         "experts": part_experts}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048, help="experts: text tokens routed")
    ap.add_argument("--drafts", type=int, nargs="+", default=list(range(1, 8)),
                    help="decode: the N of verify(N+1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.child:                          # a fresh process per part: its own peak RSS
        out = subprocess.run([sys.executable, *sys.argv, "--child"], check=True,
                             capture_output=True, text=True).stdout
        print(out, end="")
        return
    print(json.dumps(PARTS[a.part](a), indent=1))


if __name__ == "__main__":
    main()
