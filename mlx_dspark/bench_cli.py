"""``mlx-dspark bench``: serial vs speculative decoding, in the same run, on the same prompts.

DESIGN §10. Every prompt of the built-in set (code, math, open chat) is decoded greedily three
ways: serial (``speculative=False``), speculative on every round (``True``) and the break-even
controller's choice (``"auto"``, what users get by default). One warm-up generation in each
mode comes first; with ``--repeats R`` the run with the median tokens/s is kept. Speculation is
lossless, so greedy outputs of the three modes are compared token for token and the report says
how many prompts matched (on bf16 a near-tie in the target's own logits can flip a token).

Reported per prompt and per domain: decode tokens/s of each mode and the speedups, mean
accepted drafts per round, acceptance by position, the draft/verify/rollback/other time of a
round, the speedup the cost model predicts from those measured parts
(``tokens per round x serial step time / round time``) and efficiency = measured / predicted;
for serial decoding, the weight bytes read per token x tokens/s against the machine's measured
memory-copy bandwidth (the limit of memory-bound decoding)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from .commands import CommandError, load_pair

# Short prompts written for this benchmark. Code prompts are completions (the demo pair is a
# code model); math and chat prompts go through the chat template when the model has one.
PROMPTS = {
    "code": [
        "def fibonacci(n):\n",
        'def is_prime(n):\n    """Return True if n is a prime number."""\n',
        'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
        "def binary_search(items, target):\n",
    ],
    "math": [
        "What is 17 * 24? Show your working.",
        "Solve for x: 3x + 7 = 22.",
        "A train travels 120 km in 1.5 hours. What is its average speed?",
    ],
    "chat": [
        "Write a short poem about the sea.",
        "Give three tips for learning a new language.",
        "Explain what a hash table is to a beginner.",
    ],
}
CHAT_DOMAINS = ("math", "chat")
MODES = {"serial": False, "speculative": True, "auto": "auto"}


def run(args: argparse.Namespace) -> int:
    domains = _domains(args.domains)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CommandError("--plot needs matplotlib, which is not installed "
                               "(pip install matplotlib)") from None
    args.speculative = "on"      # load_pair: a drafter is required
    pair = load_pair(args)
    prompts = [(d, p) for d in domains for p in PROMPTS[d][:args.limit]]
    report = measure(pair, prompts, args)
    report["model"] = args.model or "embedded demo pair"
    report["drafter"] = args.drafter or ("embedded demo drafter" if args.model is None else None)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"bench: wrote {args.plot}", file=sys.stderr)
    return 0


def _domains(spec: str | None) -> list[str]:
    if not spec:
        return list(PROMPTS)
    names = [d.strip() for d in spec.split(",") if d.strip()]
    unknown = [d for d in names if d not in PROMPTS]
    if unknown or not names:
        raise CommandError(f"--domains: unknown domain(s) {', '.join(unknown) or spec!r}; "
                           f"choose from {', '.join(PROMPTS)}")
    return names


# ---------------------------------------------------------------------------------------------
# Measuring


def measure(pair, prompts, args) -> dict:
    from . import api
    from .chat import encode_chat

    def ids(domain, text):
        if domain in CHAT_DOMAINS and getattr(pair.tokenizer, "has_chat_template", False):
            return encode_chat(pair.tokenizer, [{"role": "user", "content": text}], {})[0]
        return list(pair.tokenizer.encode(text))

    def once(prompt_ids, mode, max_tokens):
        t0 = time.perf_counter()
        r = api.generate(pair, prompt_ids, max_tokens=max_tokens, num_draft=args.num_draft,
                         speculative=MODES[mode])
        return r.tokens, _run_summary(r.stats, time.perf_counter() - t0)

    _progress("warming up")
    first = ids(*prompts[0])
    for mode in MODES:
        once(first, mode, min(args.max_tokens, 16))
    rows = []
    for i, (domain, text) in enumerate(prompts, 1):
        prompt_ids = ids(domain, text)
        row = {"domain": domain, "prompt": text, "prompt_tokens": len(prompt_ids)}
        outputs = {}
        for mode in MODES:
            runs = [once(prompt_ids, mode, args.max_tokens) for _ in range(args.repeats)]
            runs.sort(key=lambda r: r[1]["tokens_per_s"])
            outputs[mode], row[mode] = runs[len(runs) // 2]
        row["same_tokens"] = outputs["serial"] == outputs["speculative"] == outputs["auto"]
        row.update(_speedups([row]))
        rows.append(row)
        _progress(f"[{i}/{len(prompts)}] {domain:5} {_short(text):32} serial "
                  f"{row['serial']['tokens_per_s']:6.1f} tok/s, speculative "
                  f"{row['speculative']['tokens_per_s']:6.1f} ({row['speedup']:.2f}x), auto "
                  f"{row['auto']['tokens_per_s']:6.1f} ({row['auto_speedup']:.2f}x)")
    _progress("measuring memory-copy bandwidth")
    bytes_per_token = weight_bytes_per_token(pair.target)
    domains = {d: _aggregate([r for r in rows if r["domain"] == d])
               for d in dict.fromkeys(r["domain"] for r in rows)}
    overall = _aggregate(rows)
    serial_tps = overall["serial_tokens_per_s"]
    return {
        "machine": machine(),
        "settings": {"max_tokens": args.max_tokens, "num_draft": args.num_draft,
                     "repeats": args.repeats, "temperature": 0.0,
                     "dtype": str(getattr(pair.target, "dtype", "")).replace("mlx.core.", "")},
        "prompts": rows,
        "domains": domains,
        "overall": overall,
        "bandwidth": {
            "weight_bytes_per_token": bytes_per_token,
            "serial_gb_per_s": bytes_per_token * serial_tps / 1e9,
            "memcpy_gb_per_s": memcpy_bandwidth() / 1e9,
        },
    }


def _run_summary(stats: dict, wall: float) -> dict:
    """One generation. Decode time is wall-clock time after the prefill (everything a user
    waits for: model calls, Python, detokenizing); the loop's own timers split the rounds."""
    t = stats["time"]
    rounds = stats["rounds"]
    decode_tokens = max(stats["generated_tokens"] - 1, 0)   # the first comes from the prefill
    decode_time = wall - t["prefill"]
    return {
        "tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
        "generated_tokens": stats["generated_tokens"],
        "decode_tokens": decode_tokens,
        "decode_time": decode_time,
        "serial_steps": stats["serial_steps"],
        "serial_step_time": t["serial"] / stats["serial_steps"] if stats["serial_steps"] else None,
        "rounds": rounds,
        "round_time": t["draft"] + t["verify"] + t["rollback"] + t["other"],
        "time_per_round": {k: t[k] / rounds if rounds else None
                           for k in ("draft", "verify", "rollback", "other")},
        "tokens_per_round": stats["mean_tokens_per_round"],
        "mean_accepted_per_round": stats["mean_accepted_per_round"],
        "acceptance_by_position": stats["acceptance_by_position"],
        "tested_by_position": stats["tested_by_position"],
        "mode": stats["mode"],
        "mode_switches": stats["mode_switches"],
    }


def _rate(runs, key="decode_tokens", time_key="decode_time") -> float:
    t = sum(r[time_key] for r in runs)
    return sum(r[key] for r in runs) / t if t else 0.0


def _speedups(rows) -> dict:
    serial_runs, spec_runs = [r["serial"] for r in rows], [r["speculative"] for r in rows]
    serial, spec = _rate(serial_runs), _rate(spec_runs)
    auto = _rate([r["auto"] for r in rows])
    # The cost model (DESIGN §8) from measured parts: tokens per round x serial step time /
    # round time (draft + verify + rollback + other), the loop's timers only.
    steps = sum(r["serial_steps"] for r in serial_runs)
    step_time = sum(r["serial_step_time"] * r["serial_steps"] for r in serial_runs
                    if r["serial_steps"]) / steps if steps else None
    rounds = sum(r["rounds"] for r in spec_runs)
    round_tokens = sum(r["tokens_per_round"] * r["rounds"] for r in spec_runs)
    round_time = sum(r["round_time"] for r in spec_runs)
    predicted = round_tokens * step_time / round_time if rounds and round_time and step_time \
        else None
    speedup = spec / serial if serial else None
    return {"speedup": speedup, "auto_speedup": auto / serial if serial else None,
            "predicted_speedup": predicted,
            "efficiency": speedup / predicted if predicted and speedup is not None else None}


def _aggregate(rows) -> dict:
    spec_runs = [r["speculative"] for r in rows]
    n = len(spec_runs[0]["tested_by_position"])
    tested = [sum(r["tested_by_position"][i] for r in spec_runs) for i in range(n)]
    accepted = [sum(round(r["acceptance_by_position"][i] * r["tested_by_position"][i])
                    for r in spec_runs if r["tested_by_position"][i]) for i in range(n)]
    rounds = sum(r["rounds"] for r in spec_runs)
    time_per_round = {k: sum(r["time_per_round"][k] * r["rounds"] for r in spec_runs
                             if r["rounds"]) / rounds if rounds else None
                      for k in ("draft", "verify", "rollback", "other")}
    return {
        "prompts": len(rows),
        "serial_tokens_per_s": _rate([r["serial"] for r in rows]),
        "speculative_tokens_per_s": _rate(spec_runs),
        "auto_tokens_per_s": _rate([r["auto"] for r in rows]),
        **_speedups(rows),
        "mean_accepted_per_round": sum(accepted) / rounds if rounds else 0.0,
        "acceptance_by_position": [a / t if t else None for a, t in zip(accepted, tested)],
        "time_per_round": time_per_round,
        "same_tokens": sum(r["same_tokens"] for r in rows),
    }


def weight_bytes_per_token(target) -> int:
    """Bytes of target weights one decode step reads: everything but the embedding table (one
    row) and the routed experts that are not picked (top-k of E)."""
    from mlx.utils import tree_flatten

    cfg = target.config
    experts = getattr(cfg, "n_routed_experts", 0) or 0
    topk = getattr(cfg, "num_experts_per_tok", 0) or 0
    total = 0
    for name, p in tree_flatten(target.parameters()):
        if "embed" in name:
            total += p.nbytes // p.shape[0]
        elif experts and p.ndim >= 2 and p.shape[0] == experts and "mixer" in name:
            total += p.nbytes * topk // experts
        else:
            total += p.nbytes
    return total


def memcpy_bandwidth(nbytes: int = 1 << 27, repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` large copies (read + write counted)."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def machine() -> dict:
    import os

    import mlx.core as mx

    return {"system": platform.system(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "mlx": mx.__version__,
            "device": "gpu" if mx.metal.is_available() else "cpu"}


# ---------------------------------------------------------------------------------------------
# Reporting


def table(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [
        f"mlx-dspark bench: {report['model']} + {report['drafter']}, greedy, "
        f"{s['max_tokens']} tokens per prompt, {s['num_draft']} drafts per round, "
        f"{s['dtype']}, median of {s['repeats']}",
        f"machine: {m['system']} {m['machine']}, {m['cpu_count']} cores, MLX {m['mlx']} "
        f"({m['device']})",
        "",
        f"{'domain':8}{'prompts':>8}{'serial':>10}{'spec.':>10}{'speedup':>9}{'auto':>10}"
        f"{'speedup':>9}{'acc/round':>11}  acceptance by position",
        f"{'':8}{'':>8}{'tok/s':>10}{'tok/s':>10}{'':>9}{'tok/s':>10}{'':>9}",
    ]
    for name, d in [*report["domains"].items(), ("all", report["overall"])]:
        lines.append(
            f"{name:8}{d['prompts']:>8}{d['serial_tokens_per_s']:>10.1f}"
            f"{d['speculative_tokens_per_s']:>10.1f}{_x(d['speedup']):>9}"
            f"{d['auto_tokens_per_s']:>10.1f}{_x(d['auto_speedup']):>9}"
            f"{d['mean_accepted_per_round']:>11.2f}  {_positions(d['acceptance_by_position'])}")
    o, b = report["overall"], report["bandwidth"]
    tpr = o["time_per_round"]
    lines += [""]
    if tpr["draft"] is not None:
        lines.append("speculative round: " + ", ".join(
            f"{k} {tpr[k] * 1e3:.2f} ms" for k in ("draft", "verify", "rollback", "other")))
    lines += [
        f"cost model: predicted speedup {_x(o['predicted_speedup'])}, measured "
        f"{_x(o['speedup'])} (efficiency {_pct(o['efficiency'])})",
        f"serial: {b['weight_bytes_per_token'] / 1e6:.2f} MB of weights per token x "
        f"{o['serial_tokens_per_s']:.1f} tokens/s = {b['serial_gb_per_s']:.2f} GB/s, against "
        f"{b['memcpy_gb_per_s']:.1f} GB/s memory-copy bandwidth",
        f"greedy outputs identical in all three modes: {o['same_tokens']}/{o['prompts']} prompts",
    ]
    return "\n".join(lines)


def plot(report: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, d in [*report["domains"].items(), ("all", report["overall"])]:
        acc = d["acceptance_by_position"]
        left.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc],
                  marker="o", label=name)
    positions = range(1, report["settings"]["num_draft"] + 1)
    left.set(title="acceptance by draft position", xlabel="position", ylabel="acceptance",
             ylim=(0, 1), xticks=list(positions))
    left.legend()
    names = [*report["domains"], "all"]
    rows = [report["domains"].get(n, report["overall"]) for n in names]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], [r["speedup"] or 0 for r in rows], 0.4, label="speculative")
    right.bar([x + 0.2 for x in xs], [r["auto_speedup"] or 0 for r in rows], 0.4, label="auto")
    right.axhline(1.0, color="gray", linewidth=1)
    right.set(title="speedup over serial", xticks=list(xs), xticklabels=names)
    right.legend()
    m = report["machine"]
    fig.suptitle(f"{report['model']} on {m['system']} {m['machine']} ({m['device']})")
    fig.tight_layout()
    fig.savefig(path)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _positions(acc) -> str:
    return " ".join("-" if a is None else f"{a:.2f}" for a in acc)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 30 else text[:29] + "…"


def _progress(msg: str):
    print(f"bench: {msg}", file=sys.stderr, flush=True)
