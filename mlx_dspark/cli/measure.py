"""Serial vs speculative decoding measured in the same run (docs/design.md §10).

For each repeat, every prompt is decoded serially, speculatively and with "auto", interleaved,
so that load drifts on the machine hit all three alike. A warm-up pass comes first; the reported
rates are medians over repeats. From the speculative runs' measured parts the cost model of
docs/design.md §8 predicts the speedup,

    predicted = decode_tokens * t_step / (rounds * (t_draft + t_verify + t_rollback)
                                          + serial_steps * t_step)

(per-round part times, ``t_step`` the serial run's time per token); ``efficiency`` = measured /
predicted is then the share of the model's promise the engine delivers, and the per-round time
outside draft/verify/rollback is the engine's own overhead. ``testing.compare`` runs the same
measurement on token-id prompts with any drafter (the loop benchmark's oracle drafters)."""

from __future__ import annotations

import statistics

from ..decode.loop import decode
from ..decode.session import Session
from ..request import Request
from ..stats import Stats

MODES = {"serial": "off", "speculative": "on", "auto": "auto"}   # bench's name -> the mode


def run_once(target, drafter, request: Request, home=None) -> tuple[list[int], Stats]:
    """Decode ``request`` on a fresh session (without the drafter when the request never
    speculates, as ``generate()`` does). ``home`` keeps "auto"'s controller between calls:
    the pair, as successive ``generate()`` calls do; None learns from nothing."""
    stats = Stats()
    session = Session(target, drafter if request.speculative != "off" else None, home=home)
    return list(decode(session, request, stats)), stats


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


def _decode_time(s: Stats) -> float:
    return s.t_serial + s.t_round


def _rate(stats_list) -> float:
    tokens = sum(s.generated - 1 for s in stats_list)
    return tokens / sum(_decode_time(s) for s in stats_list)


def summarize(runs: dict, num_draft: int) -> dict:
    med = statistics.median
    rate = {m: med(_rate(r) for r in runs[m]) for m in MODES}
    t_step = med(sum(s.t_serial for s in r) / sum(s.serial_steps for s in r)
                 for r in runs["serial"])
    spec = [s for r in runs["speculative"] for s in r]
    rounds = sum(s.rounds for s in spec)
    per_round = {k: sum(getattr(s, f"t_{k}") for s in spec) / rounds
                 for k in ("draft", "verify", "rollback", "round")}
    overhead = per_round["round"] - per_round["draft"] - per_round["verify"] \
        - per_round["rollback"]
    parts = per_round["draft"] + per_round["verify"] + per_round["rollback"]
    decode_tokens = sum(s.generated - 1 for s in spec)
    serial_in_spec = sum(s.serial_steps for s in spec)
    predicted = decode_tokens * t_step / (rounds * parts + serial_in_spec * t_step)
    tested = [sum(s.tested_by_position[i] for s in spec) for i in range(num_draft)]
    accepted = [sum(s.accepted_by_position[i] for s in spec) for i in range(num_draft)]
    auto = [s for r in runs["auto"] for s in r]
    auto_round_tokens = sum(s.generated - 1 - s.serial_steps for s in auto)
    measured = rate["speculative"] / rate["serial"]
    auto_share = auto_round_tokens / sum(s.generated - 1 for s in auto)
    return {
        "tokens_per_s": rate,
        "speedup": measured,
        "predicted_speedup": predicted,
        "efficiency": measured / predicted,
        "auto_vs_serial": rate["auto"] / rate["serial"],
        "auto_vs_best": rate["auto"] / max(rate["serial"], rate["speculative"]),
        "auto_speculative_share": auto_share,
        "auto_picked_faster": (auto_share > 0.5) == (measured > 1.0),
        "mean_tokens_per_round": (decode_tokens - serial_in_spec) / rounds,
        "acceptance_by_position": [a / t if t else None for a, t in zip(accepted, tested)],
        "serial_step_ms": 1e3 * t_step,
        "draft_cost": per_round["draft"] / t_step,          # c: a round's drafting, in steps
        "verify_cost": per_round["verify"] / t_step,
        "round_ms": {k: 1e3 * v for k, v in per_round.items()},
        "overhead_ms_per_round": 1e3 * overhead,
        "overhead_share": overhead / per_round["round"],
    }


def format_rows(rows: dict) -> str:
    """A Markdown table, one row per named result of :func:`summarize`."""
    head = ("| case | serial tok/s | spec tok/s | auto tok/s | tokens/round | speedup | predicted "
            "| efficiency | auto/serial | auto spec share | draft / verify / rollback / overhead "
            "ms per round | overhead share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        t, ms = r["tokens_per_s"], r["round_ms"]
        lines.append(
            f"| {name} | {t['serial']:.1f} | {t['speculative']:.1f} | {t['auto']:.1f} | "
            f"{r['mean_tokens_per_round']:.2f} | {r['speedup']:.2f}x | "
            f"{r['predicted_speedup']:.2f}x | {r['efficiency']:.2f} | {r['auto_vs_serial']:.2f} | "
            f"{r['auto_speculative_share']:.2f} | {ms['draft']:.2f} / {ms['verify']:.2f} / "
            f"{ms['rollback']:.2f} / {r['overhead_ms_per_round']:.2f} | "
            f"{100 * r['overhead_share']:.1f}% |")
    return "\n".join(lines)
