"""``mlx-dspark bench``: serial vs speculative decoding, in the same run, on the same prompts.

docs/design.md §10. The measuring is :mod:`mlx_dspark.cli.measure` (modes interleaved per prompt, warm-up
first, medians over repeats, the cost model's predicted speedup and the efficiency); this
module adds the built-in prompt set (code, math, open chat), the summaries per prompt, per
domain and overall, a check that the three modes' outputs are identical (greedy, or sampled with
the reproducible scheme; on bf16 a near-tie in the target's own logits may flip a token; with
rejection sampling they agree only in distribution), the serial decode's
weight bandwidth against the machine's memory-copy bandwidth, and the report: a table, JSON or
a PNG plot."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from .. import api
from ..request import AUTO_DRAFT
from ..stats import format_positions
from .common import CommandError, flag_error, load_pair
from .measure import SPREAD, ranged

F1 = "{:.1f}"

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


def run(args: argparse.Namespace) -> int:
    domains = _domains(args.domains)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CommandError("--plot needs matplotlib, which is not installed "
                               "(pip install matplotlib)") from None
    names = _drafter_names(args)
    num_drafts = list(dict.fromkeys(args.num_draft))
    # what load_pair warms up: every length "auto" may choose (measuring its cost curve)
    args.drafter = names[0]
    args.num_draft = AUTO_DRAFT if AUTO_DRAFT in num_drafts else max(num_drafts)
    pair = load_pair(args)
    if pair.drafter is None:
        raise CommandError("bench compares serial with speculative decoding: pass --drafter DIR")
    prompts = [(d, p) for d in domains for p in PROMPTS[d][:args.limit]]
    if len(names) > 1 or len(num_drafts) > 1:
        if args.plot:
            raise CommandError("--plot draws one drafter at one --num-draft; drop it to "
                               "compare several")
        drafters, skipped = {_label(names[0], args): pair.drafter}, {}
        for name in names[1:]:
            try:
                drafters[_label(name, args)] = api.load_another_drafter(
                    pair, name, demo=args.model is None, verify=args.verify)
            except (OSError, ValueError) as e:
                if args.drafters != "all":
                    raise CommandError(" ".join(str(e).split())) from None
                skipped[name] = " ".join(str(e).split())     # a kind this pair cannot run
                _progress(f"--drafters all: {name} skipped: {skipped[name]}")
        try:
            report = compare(pair, drafters, num_drafts, prompts, args)
            report["skipped"] = skipped
        except ValueError as e:
            raise flag_error(e) from None
        report["model"] = args.model or "embedded demo target"
        print(json.dumps(report, indent=1) if args.json else compare_table(report))
        return 0
    args.num_draft = num_drafts[0]
    try:
        report = measure(pair, prompts, args)
    except ValueError as e:      # a request the pair cannot serve (--num-draft beyond it)
        raise flag_error(e) from None
    report["model"] = args.model or "embedded demo target"
    report["drafter"] = args.drafter or ("embedded demo drafter" if args.model is None else None)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"bench: wrote {args.plot}", file=sys.stderr)
    return 0


def _drafter_names(args) -> list:
    """The drafters to compare: ``--drafter`` (repeated), or ``--drafters all`` (every kind
    the registry holds, drafters/__init__.py KINDS: the pair's default drafter first, the
    kinds this pair cannot run skipped and listed) or ``--drafters A,B``."""
    from ..drafters import DEFAULT_DEMO, NAMES

    if args.drafters and args.drafter:
        raise CommandError("--drafters and --drafter name the drafters twice: give one")
    if args.drafters == "all":
        names = [None] + [n for n in NAMES if n != DEFAULT_DEMO or args.model is not None]
    elif args.drafters:
        names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    else:
        names = args.drafter or [None]
    if len(set(names)) != len(names):
        twice = dict.fromkeys(n for n in names if names.count(n) > 1)
        raise CommandError(f"--drafter: {', '.join(twice)} given twice")
    return names


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


def _ids(pair, domain, text) -> list[int]:
    from ..text.tokenizer import prompt_ids
    chat = domain in CHAT_DOMAINS and getattr(pair.tokenizer, "has_chat_template", False)
    return prompt_ids(pair.tokenizer, text, chat)


def measure(pair, prompts, args) -> dict:
    from ..request import Request
    from . import measure

    def once(prompt, mode, max_tokens, seed=0):
        # "auto" runs as successive generate() calls on one pair do: each starts from what
        # the pair's controller learned in the calls before it.
        request = Request(prompt, max_tokens=max_tokens, temperature=args.temp,
                          top_p=args.top_p, sampling=args.sampling, num_draft=args.num_draft,
                          speculative=measure.MODES[mode], seed=seed)
        return measure.run_once(pair.target, pair.drafter, request,
                              home=pair if mode == "auto" else None)

    encoded = [_ids(pair, d, t) for d, t in prompts]
    positions = _positions(pair.drafter, args.num_draft)
    _progress("warming up")
    for mode in measure.MODES:
        once(encoded[0], mode, min(args.max_tokens, 16))

    def progress(rep, i, per_mode):
        domain, text = prompts[i]
        r = measure.summarize({m: [[per_mode[m][i]]] for m in measure.MODES}, positions)
        t = r["tokens_per_s"]
        _progress(f"[{rep * len(prompts) + i + 1}/{args.repeats * len(prompts)}] "
                  f"{domain:5} {_short(text):32} serial {t['serial']:6.1f} tok/s, "
                  f"speculative {t['speculative']:6.1f} ({r['speedup']:.2f}x), "
                  f"auto {t['auto']:6.1f} ({r['auto_vs_serial']:.2f}x)")

    def run(i, mode, seed):
        return once(encoded[i], mode, args.max_tokens, seed=seed)

    # greedy or reproducible sampling: the modes give the same tokens (last repeat's shown)
    runs, outputs = measure.measure(run, len(prompts), args.repeats, progress=progress)

    def summary(which: list[int]) -> dict:
        sub = {m: [[rep[i] for i in which] for rep in runs[m]] for m in measure.MODES}
        same = sum(len({tuple(outputs[i][m]) for m in measure.MODES}) == 1 for i in which)
        return {"prompts": len(which), "same_tokens": same,
                **measure.summarize(sub, positions)}

    rows = [{"domain": d, "prompt": t, "prompt_tokens": len(p), **summary([i])}
            for i, ((d, t), p) in enumerate(zip(prompts, encoded))]
    domains = {d: summary([i for i, (dd, _) in enumerate(prompts) if dd == d])
               for d in dict.fromkeys(d for d, _ in prompts)}
    overall = summary(list(range(len(prompts))))
    _progress("measuring memory-copy bandwidth")
    bytes_per_token = weight_bytes_per_token(pair.target)
    return {
        "machine": machine(),
        "settings": _settings(pair, args, args.num_draft),
        "prompts": rows,
        "domains": domains,
        "overall": overall,
        "bandwidth": {
            "weight_bytes_per_token": bytes_per_token,
            "serial_gb_per_s": bytes_per_token * overall["tokens_per_s"]["serial"] / 1e9,
            "memcpy_gb_per_s": memcpy_bandwidth() / 1e9,
        },
    }


def _settings(pair, args, num_draft) -> dict:
    return {"max_tokens": args.max_tokens, "num_draft": num_draft, "repeats": args.repeats,
            "temperature": args.temp, "top_p": args.top_p, "sampling": args.sampling,
            "dtype": str(getattr(pair.target, "dtype", "")).replace("mlx.core.", "")}


def _label(name, args) -> str:
    import os

    from ..drafters import DEFAULT_DEMO, NAMES
    if name is None:
        return DEFAULT_DEMO if args.model is None else "drafter"
    return name if name in NAMES else \
        os.path.basename(os.path.normpath(str(name)))


def _positions(drafter, num_draft) -> int:
    """Draft positions a run at ``num_draft`` can test ("auto": the longest it may choose)."""
    from ..policy import length
    return length.longest(drafter) if num_draft == AUTO_DRAFT else num_draft


def probe_ms(target, drafter, prompt: list[int], n: int, repeats: int = 5) -> tuple:
    """Median wall times (ms) of one evaluated ``propose(n)`` and of one verify of ``n + 1``
    tokens, after ``prompt``, each alone. In a round the drafts are computed in one lazy graph
    with the verify, so the round's clock cannot split the two."""
    import statistics

    from ..decode import costs

    session, bonus = costs.scratch(target, drafter, prompt)
    times = [costs.time_round(session, bonus, n) for _ in range(repeats + 1)]
    return tuple(1e3 * statistics.median(t[k] for t in times[1:]) for k in (0, 1))


def compare(pair, drafters: dict, num_drafts: list[int], prompts, args) -> dict:
    """Serial once, then every drafter at every draft length, speculative and "auto", on the
    same prompts, interleaved per prompt. "auto" keeps one controller per drafter and length
    (its break-even decision is the drafter's own)."""
    from ..decode.session import ControllerHome
    from ..request import Request
    from . import measure

    keys = [(label, n) for label in drafters for n in num_drafts]
    modes = ["serial"] + [f"{label}@{n}:{m}" for label, n in keys
                          for m in ("speculative", "auto")]
    homes = {key: ControllerHome() for key in keys}
    encoded = [_ids(pair, d, t) for d, t in prompts]

    def once(i, mode, max_tokens, seed=0):
        drafter, home, n, spec = None, None, 1, "off"
        if mode != "serial":
            key, spec = mode.rsplit(":", 1)
            label, n = key.rsplit("@", 1)
            n = n if n == AUTO_DRAFT else int(n)
            drafter, spec = drafters[label], measure.MODES[spec]
            home = homes[(label, n)] if spec == "auto" else None
        request = Request(encoded[i], max_tokens=max_tokens, temperature=args.temp,
                          top_p=args.top_p, sampling=args.sampling, num_draft=n,
                          speculative=spec, seed=seed)
        return measure.run_once(pair.target, drafter, request, home=home)

    _progress("warming up")
    for mode in modes:
        once(0, mode, min(args.max_tokens, 16))

    def progress(rep, i, per_mode):
        _progress(f"[{rep * len(prompts) + i + 1}/{args.repeats * len(prompts)}] "
                  f"{prompts[i][0]:5} {_short(prompts[i][1]):32} " + ", ".join(
                      f"{m.split(':')[0]} {per_mode[m][i].tokens_per_s:.1f}"
                      for m in modes if not m.endswith(":auto")) + " tok/s")

    runs, outputs = measure.measure(lambda i, m, seed: once(i, m, args.max_tokens, seed),
                                  len(prompts), args.repeats, progress=progress, modes=modes)
    _progress("timing each drafter's proposals and their verify alone")
    # "auto": at the length its rounds drafted on average
    probes = {(label, n): probe_ms(pair.target, drafters[label], encoded[0],
                                   _mean_length(runs[f"{label}@{n}:speculative"], n))
              for label, n in keys}
    results = []
    groups = [(d, [i for i, (dd, _) in enumerate(prompts) if dd == d])
              for d in dict.fromkeys(d for d, _ in prompts)]
    for domain, which in groups + [("all", list(range(len(prompts))))]:
        for label, n in keys:
            key = f"{label}@{n}"
            sub = {m: [[rep[i] for i in which] for rep in runs[src]]
                   for m, src in (("serial", "serial"), ("speculative", f"{key}:speculative"),
                                  ("auto", f"{key}:auto"))}
            same = sum(outputs[i]["serial"] == outputs[i][f"{key}:speculative"]
                       == outputs[i][f"{key}:auto"] for i in which)
            r = measure.summarize(sub, _positions(drafters[label], n))
            # c and the verify cost from the probes (a round computes both in one graph)
            draft, verify = probes[(label, n)]
            r["draft_cost"] = draft / r["serial_step_ms"]
            r["verify_cost"] = verify / r["serial_step_ms"]
            spec = [s for rep in sub["speculative"] for s in rep]
            results.append({"domain": domain, "drafter": label, "num_draft": n,
                            "prompts": len(which), "same_tokens": same,
                            "drafts_per_round": sum(s.drafted for s in spec)
                            / max(1, sum(s.rounds for s in spec)),
                            "draft_ms": draft, "verify_ms": verify, **r})
    return {
        "machine": machine(),
        "settings": _settings(pair, args, num_drafts),
        "drafters": {label: getattr(d, "gate_report", None) for label, d in drafters.items()},
        "results": results,
    }


def _mean_length(runs, num_draft) -> int:
    """``num_draft``, or for "auto" the drafts per round its runs took, rounded."""
    if num_draft != AUTO_DRAFT:
        return num_draft
    stats = [s for rep in runs for s in rep]
    return max(1, round(sum(s.drafted for s in stats) / max(1, sum(s.rounds for s in stats))))


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

    preloaded = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if "blas" in lib]
    return {"system": platform.system(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "mlx": mx.__version__,
            "device": str(mx.default_device().type).removeprefix("DeviceType."),
            "blas": " ".join(preloaded) + " (preloaded)" if preloaded else "MLX's own"}


# ---------------------------------------------------------------------------------------------
# Reporting


def _title(report: dict, who: str, per_round: str = "") -> list[str]:
    s, r = report["settings"], report["settings"]["repeats"]
    spread = (f"each figure: the median of {r} repeats [{SPREAD}]; ratios paired per repeat"
              if r > 1 else "each figure from one repeat: no spread, so no mode is called "
              "faster (--repeats 3 or more)")
    return [f"mlx-dspark bench: {report['model']} {who}, {_sampling(s)}, {s['max_tokens']} "
            f"tokens per prompt, {per_round}{s['dtype']}", spread,
            _machine_line(report["machine"]), ""]


def _against(name: str, d: dict) -> str:
    """What the spread lets one say about ``name`` ("speculative", "auto") against serial."""
    v = d["verdict"][name]
    if v == "one repeat":
        return "one repeat: no spread, no verdict"
    lo, hi = d["spread"]["speedup" if name == "speculative" else "auto_vs_serial"]
    if v == "within noise":
        return (f"within noise: {name} against serial ranged {lo:.2f}x–{hi:.2f}x over the "
                f"repeats, 1.0 included")
    return f"{name} is {v} than serial in every repeat ({lo:.2f}x–{hi:.2f}x)"


def auto_lines(d: dict) -> list[str]:
    """What "auto" did (its tokens from serial steps and from rounds, its probes and switches)
    and how that compares with the faster fixed mode, if the spread shows one."""
    a, share = d["auto_did"], d["auto_speculative_share"]
    ran = "speculative" if share > 0.5 else "serial"
    mostly = "only" if share in (0.0, 1.0) else "mostly"
    fixed = d["verdict"]["speculative"]
    if fixed in ("faster", "slower"):
        faster = "speculative" if fixed == "faster" else "serial"
        judged = ("the faster mode in this run" if ran == faster
                  else f"while {faster} was the faster mode in this run")
    elif fixed == "within noise":
        judged = "and serial and speculative are within noise here: neither is the faster mode"
    else:
        judged = "and one repeat cannot tell which mode is faster"
    rounds = f"{a['rounds']} rounds, {a['probe_rounds']} of them probes" if a["rounds"] \
        else "none"
    return [f"auto: {_pct(1 - share)} of its {a['tokens']} tokens from serial steps, "
            f"{_pct(share)} from speculative rounds ({rounds}), {a['switches']} "
            f"switch{'' if a['switches'] == 1 else 'es'} in {a['generations']} generations",
            f"auto ran {mostly} {ran}, {judged}; its speed "
            f"{ranged(d['auto_vs_serial'], d['spread']['auto_vs_serial'])} serial's: "
            f"{_against('auto', d)}"]


def table(report: dict) -> str:
    s = report["settings"]
    lines = _title(report, f"+ {report['drafter']}", f"{s['num_draft']} drafts per round, ") + [
        f"{'decode':8}{'prompts':>8}{'serial':>21}{'speculative':>21}{'auto':>21}{'tokens':>8}"
        f"  acceptance", f"{'tok/s':8}{'':>8}{'':>21}{'':>21}{'':>21}{'/round':>8}  by position"]
    rows = [*report["domains"].items(), ("all", report["overall"])]
    for name, d in rows:
        t, sp = d["tokens_per_s"], d["spread"]["tokens_per_s"]
        lines.append(f"{name:8}{d['prompts']:>8}" + "".join(
            f"{ranged(t[m], sp[m], F1):>21}" for m in ("serial", "speculative", "auto"))
            + f"{d['mean_tokens_per_round']:>8.2f}  "
              f"{format_positions(d['acceptance_by_position'])}")
    lines += ["", f"{'against':8}{'speculative':>19}{'':>14}{'auto':>19}",
              f"{'serial':8}{'/ serial':>19}{'verdict':>14}{'/ serial':>19}{'verdict':>14}"]
    for name, d in rows:
        sp = d["spread"]
        lines.append(f"{name:8}{ranged(d['speedup'], sp['speedup']):>19}"
                     f"{d['verdict']['speculative']:>14}"
                     f"{ranged(d['auto_vs_serial'], sp['auto_vs_serial']):>19}"
                     f"{d['verdict']['auto']:>14}")
    o, b = report["overall"], report["bandwidth"]
    unit, k = ("GB", 1) if max(v or 0 for v in o["peak_memory_gb"].values()) >= 1 else ("MB", 1e3)
    lines += ["", f"{'prompt':12}{'prefill':>21}{'first token':>21}{'peak memory':>21}",
              f"{'(all)':12}{'tok/s':>21}{'ms':>21}{unit + ' (MLX)':>21}"]
    for mode in ("serial", "speculative", "auto"):
        sp = o["spread"]
        peak, span = o["peak_memory_gb"][mode], sp["peak_memory_gb"][mode]
        cells = [ranged(o["prefill_tokens_per_s"][mode], sp["prefill_tokens_per_s"][mode], F1),
                 ranged(o["ttft_ms"][mode], sp["ttft_ms"][mode], F1),
                 ranged(peak and peak * k, span and [v * k for v in span],
                        "{:.3f}" if unit == "GB" else F1)]
        lines.append(f"{mode:12}" + "".join(f"{c:>21}" for c in cells))
    ms, sp = o["round_ms"], o["spread"]
    lines += [
        "",
        f"speculative vs serial: {ranged(o['speedup'], sp['speedup'])}, "
        f"{_against('speculative', o)}",
        f"speculative round: draft {ms['draft']:.2f} ms, verify {ms['verify']:.2f} ms, rollback "
        f"{ms['rollback']:.2f} ms, overhead {o['overhead_ms_per_round']:.2f} ms "
        f"(serial step {ranged(o['serial_step_ms'], sp['serial_step_ms'], '{:.2f}')} ms)",
        f"cost model: predicted speedup {ranged(o['predicted_speedup'], sp['predicted_speedup'])}"
        f", measured {ranged(o['speedup'], sp['speedup'])} (efficiency "
        f"{ranged(o['efficiency'], sp['efficiency'], '{:.2f}')})",
        *auto_lines(o),
        f"serial: {b['weight_bytes_per_token'] / 1e6:.2f} MB of weights per token x "
        f"{o['tokens_per_s']['serial']:.1f} tokens/s = {b['serial_gb_per_s']:.2f} GB/s, against "
        f"{b['memcpy_gb_per_s']:.1f} GB/s memory-copy bandwidth",
        f"outputs identical in all three modes: {o['same_tokens']}/{o['prompts']} prompts",
    ]
    return "\n".join(lines)


def compare_table(report: dict) -> str:
    lines = _title(report, f"with {', '.join(report['drafters'])}") + [
        "tau: tokens per round; c: a proposal, verify: a verify of N+1 tokens, each timed "
        "alone, in serial steps; predicted: the cost model's speedup from the rounds' "
        "measured parts; N a2.4: num_draft auto, 2.4 drafts per round on average (c and "
        "verify timed at that length, rounded)",
        *[f"skipped {name}: {why}" for name, why in report.get("skipped", {}).items()],
        "",
        f"{'domain':7}{'drafter':>10}{'N':>5}{'serial':>9}{'spec.':>9}{'tau':>6}{'c':>6}"
        f"{'verify':>7}{'predicted':>10}{'measured':>19}{'spec. vs':>14}{'auto':>9}{'auto':>19}"
        f"{'same':>6}",
        f"{'':7}{'':>10}{'':>5}{'tok/s':>9}{'tok/s':>9}{'':>6}{'':>6}{'':>7}{'':>10}{'':>19}"
        f"{'serial':>14}{'tok/s':>9}{'x':>19}{'':>6}",
    ]
    for r in report["results"]:
        t, sp = r["tokens_per_s"], r["spread"]
        lines.append(
            f"{r['domain']:7}{r['drafter'][-10:]:>10}{_n(r):>5}{t['serial']:>9.1f}"
            f"{t['speculative']:>9.1f}{r['mean_tokens_per_round']:>6.2f}{r['draft_cost']:>6.2f}"
            f"{r['verify_cost']:>7.2f}{ranged(r['predicted_speedup'], None):>10}"
            f"{ranged(r['speedup'], sp['speedup']):>19}{r['verdict']['speculative']:>14}"
            f"{t['auto']:>9.1f}{ranged(r['auto_vs_serial'], sp['auto_vs_serial']):>19}"
            f"{str(r['same_tokens']) + '/' + str(r['prompts']):>6}")
    return "\n".join(lines)


def _n(row: dict) -> str:
    auto = row["num_draft"] == AUTO_DRAFT
    return f"a{row['drafts_per_round']:.1f}" if auto else str(row["num_draft"])


def _machine_line(m: dict) -> str:
    return (f"machine: {m['system']} {m['machine']}, {m['cpu_count']} cores, MLX {m['mlx']} "
            f"({m['device']}), BLAS: {m.get('blas', '?')}")


def _sampling(settings: dict) -> str:
    if not settings["temperature"]:
        return "greedy"
    return (f"{settings['sampling']} sampling T={settings['temperature']:g} "
            f"top-p={settings['top_p']:g}")


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
    for shift, key, label in ((-0.2, "speedup", "speculative"), (0.2, "auto_vs_serial", "auto")):
        values = [r[key] for r in rows]       # whiskers: min-max over the repeats
        whiskers = [[v - r["spread"][key][0] for v, r in zip(values, rows)],
                    [r["spread"][key][1] - v for v, r in zip(values, rows)]]
        right.bar([x + shift for x in xs], values, 0.4, yerr=whiskers, capsize=3, label=label)
    right.axhline(1.0, color="gray", linewidth=1)
    right.set(title=f"speedup over serial\n(median, {SPREAD})", xticks=list(xs),
              xticklabels=names)
    right.legend()
    m = report["machine"]
    fig.suptitle(f"{report['model']} on {m['system']} {m['machine']} ({m['device']})")
    fig.tight_layout()
    fig.savefig(path)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 30 else text[:29] + "…"


def _progress(msg: str):
    print(f"bench: {msg}", file=sys.stderr, flush=True)
