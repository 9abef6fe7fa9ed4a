"""Step 0: pick a target shape where speculation can pay on this CPU.

Builds mlx-lm's nemotron_h with random weights for a few candidate shapes and times a
1-token and a 4-token cached forward (the serial step and an N=3 verify). Small matrices
are overhead-bound, so the 4/1 ratio falls toward 1 as the model shrinks; that ratio, not
the parameter count, decides whether a drafter can win here. Run with the runtime venv:

    /work/venv/bin/python training/measure_ratio.py
"""
import time

import mlx.core as mx
from mlx_lm.models import nemotron_h
from mlx.utils import tree_flatten

from shapes import CANDIDATES, mlx_args


def median_time(fn, reps=30):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def measure(name, cfg, quantize):
    model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(mlx_args(cfg)))
    if quantize:
        # nvfp4 only on the layers the export quantizes (Mamba in/out, experts, shared expert).
        import mlx.nn as nn
        nn.quantize(model, group_size=16, bits=4, mode="nvfp4",
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and "embeddings" not in p
                    and "lm_head" not in p and "gate" != p.split(".")[-1])
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    prompt = mx.array([[i % cfg["vocab_size"] for i in range(64)]])
    cache = model.make_cache()
    mx.eval(model(prompt, cache=cache))
    one = mx.array([[5]])
    four = mx.array([[5, 6, 7, 8]])
    # Time without letting the cache grow unboundedly: fresh cache copies are costly, so just
    # accept the slow growth (a few hundred tokens) which barely changes the cost here.
    t1 = median_time(lambda: mx.eval(model(one, cache=cache)))
    t4 = median_time(lambda: mx.eval(model(four, cache=cache)))
    print(f"{name:>10} q={quantize:d} params={n_params/1e6:5.2f}M  1-tok {t1*1e3:6.2f} ms  "
          f"4-tok {t4*1e3:6.2f} ms  ratio {t4/t1:4.2f}", flush=True)


if __name__ == "__main__":
    mx.set_default_device(mx.cpu)
    for name, cfg in CANDIDATES.items():
        for q in (False, True):
            measure(name, cfg, q)
