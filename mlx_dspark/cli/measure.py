"""Serial vs speculative decoding measured in the same run (docs/design.md §10).

For each repeat, every prompt is decoded serially, speculatively and with "auto", interleaved,
so that load drifts on the machine hit all three alike. A warm-up pass comes first; each figure
is the median over the repeats with its min-max spread, ratios paired per repeat (a mode's rate
over serial's in the same repeat), and a mode is called faster or slower than serial only when
it was so in every repeat, its ratios' range leaving out 1.0 (:func:`verdict`). From the
speculative runs' measured parts the cost model of docs/design.md §8 predicts the speedup,

    predicted = decode_tokens * t_step / (rounds * (t_draft + t_verify + t_rollback)
                                          + serial_steps * t_step)

(per-round part times, ``t_step`` the serial run's time per token); ``efficiency`` = measured /
predicted is then the share of the model's promise the engine delivers, and the per-round time
outside draft/verify/rollback is the engine's own overhead. ``testing.compare`` runs the same
measurement on token-id prompts with any drafter (the loop benchmark's oracle drafters)."""

from __future__ import annotations

import statistics

import mlx.core as mx

from ..decode.batch import decode
from ..decode.session import Session
from ..request import Request
from ..stats import Stats

MODES = {"serial": "off", "speculative": "on", "auto": "auto"}   # bench's name -> the mode


def run_once(target, drafter, request: Request, home=None) -> tuple[list[int], Stats]:
    """Decode ``request`` on a fresh session (without the drafter when the request never
    speculates, as ``generate()`` does), MLX's peak memory reset before and read after.
    ``home`` keeps "auto"'s controller between calls: the pair, as successive ``generate()``
    calls do; None learns from nothing."""
    stats = Stats()
    mx.reset_peak_memory()          # this run's peak: weights, caches and activations
    session = Session(target, drafter if request.speculative != "off" else None, home=home)
    tokens = list(decode(session, request, stats))
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return tokens, stats


def measure(run, num_prompts: int, repeats: int, first_seed: int = 0, progress=None,
            modes=tuple(MODES)):
    """The measurement loop of ``mlx-dspark bench`` (and ``testing.compare``): for each repeat, every
    prompt in every mode, interleaved. ``run(i, mode, seed) -> (tokens, Stats)`` decodes
    prompt ``i``; ``progress(rep, i, per_mode)`` (optional) is called after each prompt.
    ``modes``: their names (``bench --drafter A --drafter B`` has a speculative and an auto
    mode per drafter and draft length).

    Returns ``runs`` (mode -> per repeat, the Stats of each prompt; what :func:`summarize`
    takes) and ``outputs`` (per prompt, mode -> the tokens of the last repeat)."""
    runs = {m: [] for m in modes}
    outputs = [dict() for _ in range(num_prompts)]
    for rep in range(repeats):
        per_mode = {m: [] for m in modes}
        for i in range(num_prompts):
            for m in modes:
                outputs[i][m], stats = run(i, m, first_seed + rep)
                per_mode[m].append(stats)
            if progress is not None:
                progress(rep, i, per_mode)
        for m in modes:
            runs[m].append(per_mode[m])
    return runs, outputs


SPREAD = "min-max over the repeats"


def _rate(stats_list) -> float:
    tokens = sum(s.generated - 1 for s in stats_list)
    return tokens / sum(s.t_serial + s.t_round for s in stats_list)


def _predicted(spec: list[Stats], t_step: float) -> float | None:
    """The cost model's speedup from the speculative runs' measured parts (module doc)."""
    rounds = sum(s.rounds for s in spec)
    if not rounds:
        return None
    parts = sum(s.t_draft + s.t_verify + s.t_rollback for s in spec) / rounds
    decode_tokens = sum(s.generated - 1 for s in spec)
    serial_steps = sum(s.serial_steps for s in spec)
    return decode_tokens * t_step / (rounds * parts + serial_steps * t_step)


def _one_repeat(runs: dict) -> dict:
    """The figures of one repeat (mode -> the Stats of its prompts, pooled). Ratios are paired:
    each mode's rate over serial's in the same repeat, run interleaved with it."""
    serial = runs["serial"]
    t_step = sum(s.t_serial for s in serial) / sum(s.serial_steps for s in serial)
    rate = {m: _rate(runs[m]) for m in MODES}
    speedup = rate["speculative"] / rate["serial"]
    predicted = _predicted(runs["speculative"], t_step)
    return {
        "tokens_per_s": rate,
        "speedup": speedup,
        "predicted_speedup": predicted,
        "efficiency": speedup / predicted if predicted else None,
        "auto_vs_serial": rate["auto"] / rate["serial"],
        "auto_vs_best": rate["auto"] / max(rate["serial"], rate["speculative"]),
        "serial_step_ms": 1e3 * t_step,
        # prompt processing (prefill and the first token's pick) and MLX's peak memory
        "prefill_tokens_per_s": {m: _div(sum(s.prefilled_tokens for s in runs[m]),
                                         sum(s.t_prefill for s in runs[m])) for m in MODES},
        "ttft_ms": {m: 1e3 * statistics.mean(s.t_prefill for s in runs[m]) for m in MODES},
        "peak_memory_gb": {m: max((s.peak_memory_gb for s in runs[m]
                                   if s.peak_memory_gb is not None), default=None)
                           for m in MODES},
    }


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _median_and_range(values) -> tuple:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.median(values), [min(values), max(values)]


def verdict(ratios) -> str:
    """A mode against serial from its per-repeat ratios (rate / serial rate): "faster" or
    "slower" when every repeat says so (the ratios' min-max range leaves out 1.0), else
    "within noise"; "one repeat" when there is no spread to judge by."""
    ratios = [r for r in ratios if r is not None]
    if len(ratios) < 2:
        return "one repeat"
    if min(ratios) <= 1.0 <= max(ratios):
        return "within noise"
    return "faster" if min(ratios) > 1.0 else "slower"


def summarize(runs: dict, num_draft: int) -> dict:
    """``runs``: mode -> per repeat, the Stats of each prompt (:func:`measure`). Each figure is
    the median over the repeats, its ``spread`` the min and max over them; counts (tokens per
    round, acceptance, what "auto" did) and the round's parts pool every run."""
    per = [_one_repeat({m: runs[m][k] for m in MODES}) for k in range(len(runs["serial"]))]
    figures, spread = {}, {"kind": SPREAD, "repeats": len(per)}
    for key, first in per[0].items():
        if isinstance(first, dict):
            pairs = {m: _median_and_range(p[key][m] for p in per) for m in first}
            figures[key] = {m: v[0] for m, v in pairs.items()}
            spread[key] = {m: v[1] for m, v in pairs.items()}
        else:
            figures[key], spread[key] = _median_and_range(p[key] for p in per)
    t_step = figures["serial_step_ms"] / 1e3
    spec = [s for r in runs["speculative"] for s in r]
    rounds = sum(s.rounds for s in spec)
    per_round = {k: sum(getattr(s, f"t_{k}") for s in spec) / max(rounds, 1)
                 for k in ("draft", "verify", "rollback", "round")}
    overhead = per_round["round"] - per_round["draft"] - per_round["verify"] \
        - per_round["rollback"]
    decode_tokens = sum(s.generated - 1 for s in spec)
    serial_in_spec = sum(s.serial_steps for s in spec)
    tested = [sum(s.tested_by_position[i] for s in spec) for i in range(num_draft)]
    accepted = [sum(s.accepted_by_position[i] for s in spec) for i in range(num_draft)]
    auto = [s for r in runs["auto"] for s in r]
    auto_tokens = sum(s.generated - 1 for s in auto)
    auto_share = sum(s.generated - 1 - s.serial_steps for s in auto) / max(auto_tokens, 1)
    verdicts = {"speculative": verdict(p["speedup"] for p in per),
                "auto": verdict(p["auto_vs_serial"] for p in per)}
    decided = verdicts["speculative"] in ("faster", "slower")
    return {
        **figures,
        "spread": spread,
        "verdict": verdicts,
        "auto_speculative_share": auto_share,
        # None: serial and speculative are within noise (or one repeat), no faster mode to pick
        "auto_picked_faster": ((auto_share > 0.5) == (verdicts["speculative"] == "faster")
                               if decided else None),
        "auto_did": {"tokens": auto_tokens, "rounds": sum(s.rounds for s in auto),
                     "probe_rounds": sum(s.probe_rounds for s in auto),
                     "serial_steps": sum(s.serial_steps for s in auto),
                     "switches": sum(s.switches for s in auto), "generations": len(auto)},
        "mean_tokens_per_round": (decode_tokens - serial_in_spec) / max(rounds, 1),
        "acceptance_by_position": [a / t if t else None for a, t in zip(accepted, tested)],
        "draft_cost": per_round["draft"] / t_step,          # c: a round's drafting, in steps
        "verify_cost": per_round["verify"] / t_step,
        "round_ms": {k: 1e3 * v for k, v in per_round.items()},
        "overhead_ms_per_round": 1e3 * overhead,
        "overhead_share": overhead / per_round["round"] if per_round["round"] else 0.0,
    }


def format_rows(rows: dict) -> str:
    """A Markdown table, one row per named result of :func:`summarize`."""
    head = ("| case | serial tok/s | spec tok/s | auto tok/s | tokens/round | speedup | predicted "
            "| efficiency | auto/serial | auto spec share | draft / verify / rollback / overhead "
            "ms per round | overhead share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        t, ms, sp = r["tokens_per_s"], r["round_ms"], r["spread"]
        lines.append(
            f"| {name} | {t['serial']:.1f} | {t['speculative']:.1f} | {t['auto']:.1f} | "
            f"{r['mean_tokens_per_round']:.2f} | {ranged(r['speedup'], sp['speedup'])} "
            f"({r['verdict']['speculative']}) | {ranged(r['predicted_speedup'], None)} | "
            f"{ranged(r['efficiency'], sp['efficiency'], '{:.2f}')} | "
            f"{ranged(r['auto_vs_serial'], sp['auto_vs_serial'])} | "
            f"{r['auto_speculative_share']:.2f} | {ms['draft']:.2f} / {ms['verify']:.2f} / "
            f"{ms['rollback']:.2f} / {r['overhead_ms_per_round']:.2f} | "
            f"{100 * r['overhead_share']:.1f}% |")
    return "\n".join(lines)


def ranged(value, span, fmt: str = "{:.2f}x") -> str:
    """A median and its min-max over the repeats, ``0.46x [0.45–0.47]``; the value alone when
    the spread does not show at this precision, "-" for none."""
    if value is None:
        return "-"
    lo, hi = (fmt.format(v) for v in (span or [value, value]))
    text = fmt.format(value)
    return text if lo == hi == text else f"{text} [{lo.rstrip('x')}–{hi.rstrip('x')}]"
