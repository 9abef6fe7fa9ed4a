"""Issue 16's measurements, in one run: serial decoding against mlx-lm on the same weights,
graph primitives per serial step / verify / round next to mlx-lm's, and per speculative round
the wall time, the blocking host reads and the overhead beyond its measured parts.

``--before DIR`` adds an earlier version of the engine, measured in the same process: DIR holds
that version's package renamed ``mlx_dspark_before`` (with its ``kernels`` and ``converter``
inside), made with

    git archive dc50bd4 mlx_dspark kernels converter | tar -x -C /tmp/before
    cd /tmp/before && mv mlx_dspark mlx_dspark_before && mv kernels converter mlx_dspark_before/

Weights: the embedded demo target (NVFP4 codes), and for the comparison with mlx-lm a random
fp32 model of the demo's shape loaded into both engines (mlx-lm cannot run the demo's NVFP4
tensor scales). Greedy; medians after a warm-up, implementations interleaved per repeat.

    python benchmarks/bench_gpu_loop.py [--before /tmp/before] [--tokens 96] [--repeats 5]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_gpu_loop.py ...
"""

from pathlib import Path
import argparse
import importlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from bench_loop import DEMO_SHAPE
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config

PROMPT = [(37 * i) % 4000 + 11 for i in range(40)]


def primitives(*outs) -> int:
    """Graph primitives MLX would run to evaluate ``outs`` (evaluated inputs are leaves)."""
    f = io.StringIO()
    mx.export_to_dot(f, *outs)
    return sum("shape=rectangle" in line for line in f.getvalue().splitlines())


def cache_arrays(spec, cache) -> list:
    """A target cache's arrays (the earlier version walked the cache in the loop module)."""
    return cache.arrays() if hasattr(cache, "arrays") else spec._arrays(cache)


# The engines' own APIs: this version decodes ``decode(Session(target, drafter), Request(...))``
# with the drafter's context in the session (``session.draft_cache``); the earlier one
# (``--before``) took ``decode(target, drafter, prompt, ...)`` and kept the context in the
# drafter (``drafter._cache``).


def new_api(pkg) -> bool:
    return importlib.util.find_spec(pkg.__name__ + ".request") is not None


def make_session(pkg, target, drafter):
    if new_api(pkg):
        return importlib.import_module(pkg.__name__ + ".session").Session(target, drafter)
    return importlib.import_module(pkg.__name__ + ".speculative").Session(target, drafter)


def run_decode(pkg, target, drafter, prompt, tokens, speculative: bool):
    """Decode ``prompt`` to ``tokens`` tokens, greedy, on a fresh session; returns the stats."""
    spec = importlib.import_module(pkg.__name__ + ".speculative")
    if not new_api(pkg):
        stats = spec.Stats()
        for _ in spec.decode(target, drafter, prompt, max_tokens=tokens,
                             speculative=speculative, stats=stats):
            pass
        return stats
    Request = importlib.import_module(pkg.__name__ + ".request").Request
    stats = importlib.import_module(pkg.__name__ + ".stats").Stats()
    request = Request(prompt, max_tokens=tokens, speculative=speculative)
    for _ in spec.decode(make_session(pkg, target, drafter), request, stats):
        pass
    return stats


def draft_tokens(session, bonus, n):
    """The session's drafter proposes ``n`` tokens after ``bonus`` from the session's context."""
    if hasattr(session, "draft_cache"):
        return session.drafter.propose(bonus, n, cache=session.draft_cache)
    return session.drafter.propose(bonus, n)


def draft_arrays(session) -> list:
    """The drafter context's arrays (the session's cache, or the earlier drafter's own)."""
    if hasattr(session, "draft_cache"):
        return session.draft_cache.arrays()
    return [x for kv in session.drafter._cache for x in kv]


class HostReads:
    """Counts calls that make the host wait for the device (mx.eval and array reads)."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.count, self.saved = 0, [(mx, "eval", mx.eval)] + [
            (mx.array, m, getattr(mx.array, m)) for m in self.METHODS]
        for owner, name, f in self.saved:
            setattr(owner, name, self._counted(f))
        return self

    def _counted(self, f):
        def wrapper(*a, **k):
            self.count += 1
            return f(*a, **k)
        return wrapper

    def __exit__(self, *exc):
        for owner, name, f in self.saved:
            setattr(owner, name, f)


def engines(before_dir):
    out = {"after": importlib.import_module("mlx_dspark")}
    if before_dir:
        sys.path.insert(0, before_dir)
        out["before"] = importlib.import_module("mlx_dspark_before")
    return out


def serial_rate(pkg, target, tokens) -> float:
    stats = run_decode(pkg, target, None, PROMPT, tokens, speculative=False)
    return stats.as_dict()["tokens_per_s"]


def mlx_lm_rate(model, tokens) -> float:
    gen = generate_step(mx.array(PROMPT), model, max_tokens=tokens)
    next(gen)                                   # the prefill's token, as ours excludes it
    t0 = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t0)


def count_graphs(pkg, target, drafter, n=3) -> dict:
    """Primitives of one serial step, one verify(n+1), one proposal(n) and one whole round."""
    spec = importlib.import_module(pkg.__name__ + ".speculative")
    session = make_session(pkg, target, drafter)
    mx.eval(spec.prefill(session, PROMPT, tap=True), session.pending)
    logits, taps = target.step(mx.array([[7]]), session.cache, tap_layers=session.tap_layers)
    step = primitives(mx.argmax(logits[0, -1]), taps)
    mx.eval(logits, taps)
    session.feed([7], taps)
    session.flush()
    mx.eval(draft_arrays(session))
    drafts, _ = draft_tokens(session, 9, n)
    propose = primitives(drafts)
    mx.eval(drafts)
    v_logits, v_taps = target.verify(mx.array([[9] + drafts.tolist()]), session.cache,
                                     tap_layers=session.tap_layers)
    verify = primitives(v_logits, v_taps)
    mx.eval(v_logits, v_taps)
    sampling = importlib.import_module(pkg.__name__ + ".sampling")
    if hasattr(sampling, "accept_coupled"):        # accept on device
        accept = primitives(*sampling.accept_coupled(drafts, mx.argmax(v_logits[0], -1)))
    else:                                           # argmax, then compared on the host
        accept = primitives(mx.argmax(v_logits[0], -1))
    target.commit(session.cache, 1)
    rollback = primitives(*cache_arrays(spec, session.cache))
    mx.eval(cache_arrays(spec, session.cache))
    session.feed([9], v_taps[:1])
    evaluate, mx.eval = mx.eval, lambda *a: None    # the earlier version evaluated inside
    session.flush()
    mx.eval = evaluate
    add_context = primitives(*draft_arrays(session))
    return {"serial_step": step, "propose": propose, "verify": verify, "accept": accept,
            "rollback": rollback, "add_context": add_context,
            "round": add_context + propose + verify + accept + rollback}


def mlx_lm_step_primitives(model) -> int:
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache), [c.state for c in cache])
    return primitives(mx.argmax(model(mx.array([[7]]), cache=cache)[:, -1], -1))


class RoundProfile:
    """Forced speculation with the demo pair: per-round wall time and blocking host reads,
    and the overhead beyond the round's parts timed one by one (cost model, docs/design.md §8)."""

    def __init__(self, pkg, tokens):
        self.pkg, self.spec = pkg, importlib.import_module(pkg.__name__ + ".speculative")
        pair = pkg.load()
        self.t, self.d, self.tokens = pair.target, pair.drafter, tokens
        self.prompt = pair.tokenizer.encode("def fibonacci(n):\n")
        self.rounds, self.reads, self.parts = [], [], []

    def measure(self):
        spec, t, d = self.spec, self.t, self.d
        with HostReads() as h:
            stats = run_decode(self.pkg, t, d, self.prompt, self.tokens, speculative=True)
        self.rounds.append(stats.t_round / stats.rounds)
        self.reads.append((h.count - 1) / stats.rounds)      # minus the prefill's read
        # the parts, each evaluated alone: propose(3), verify(4), rollback to 2 positions
        session = make_session(self.pkg, t, d)
        mx.eval(spec.prefill(session, self.prompt, tap=True), session.pending)
        session.flush()
        for _ in range(8):
            t0 = time.perf_counter()
            drafts, _ = draft_tokens(session, 9, 3)
            mx.eval(drafts)
            t1 = time.perf_counter()
            lg, tp = t.verify(mx.array([[9] + drafts.tolist()]), session.cache,
                              tap_layers=session.tap_layers)
            mx.eval(lg, tp)
            t2 = time.perf_counter()
            t.commit(session.cache, 2)
            mx.eval(cache_arrays(spec, session.cache))
            self.parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

    def report(self) -> dict:
        med = [statistics.median(p[i] for p in self.parts[8:]) for i in range(3)]
        round_s = statistics.median(self.rounds[1:])
        return {"round_ms": 1e3 * round_s, "parts_ms": [1e3 * x for x in med],
                "overhead_ms": 1e3 * (round_s - sum(med)),
                "blocking_reads_per_round": statistics.median(self.reads[1:])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="directory holding mlx_dspark_before (see the docstring)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    impls = engines(a.before)
    over = dict(DEMO_SHAPE)
    cfg = tiny_config(over.pop("pattern"), **over)
    ref = random_mlx_lm_model(cfg, 0)
    weights = hf_weights_from_mlx_lm(ref, stacked=True)
    random_targets, demo_targets = {}, {}
    for name, pkg in impls.items():
        T = importlib.import_module(pkg.__name__ + ".target")
        random_targets[name] = T.NemotronH(T.TargetConfig.from_dict(cfg), weights, mx.float32)
        demo_targets[name] = pkg.load().target
    rates = {k: [] for k in [f"{n} random" for n in impls] + [f"{n} demo" for n in impls]
             + ["mlx-lm random"]}
    for rep in range(a.repeats + 1):
        for name in impls:
            rates[f"{name} random"].append(serial_rate(impls[name], random_targets[name],
                                                       a.tokens))
            rates[f"{name} demo"].append(serial_rate(impls[name], demo_targets[name], a.tokens))
        rates["mlx-lm random"].append(mlx_lm_rate(ref, a.tokens))
    serial = {k: statistics.median(v[1:]) for k, v in rates.items()}
    graphs = {}
    for name, pkg in impls.items():
        pair = pkg.load()
        graphs[f"{name} demo"] = count_graphs(pkg, pair.target, pair.drafter)
    graphs["mlx-lm random"] = {"serial_step": mlx_lm_step_primitives(ref)}
    graphs["after random"] = {"serial_step": count_graphs(
        impls["after"], random_targets["after"], impls["after"].load().drafter)["serial_step"]}
    profiles = {name: RoundProfile(pkg, 64) for name, pkg in impls.items()}
    for rep in range(a.repeats + 1):
        for name in (list(profiles) if rep % 2 else list(profiles)[::-1]):
            profiles[name].measure()
    rounds = {name: p.report() for name, p in profiles.items()}
    report = {"blas": os.environ.get("LD_PRELOAD", "") or "MLX's bundled BLAS",
              "serial_tokens_per_s": serial, "primitives": graphs, "rounds": rounds}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
