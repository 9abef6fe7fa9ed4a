"""A bench you can trust (issue 33, item 5): every figure has its spread over the repeats, a
difference smaller than the spread is called noise instead of a winner (table and JSON), the
"auto" line says what auto ran, and prefill speed, time to first token and peak memory are
measured per mode. The verdicts are checked on constructed measurements (the machine's own
noise would make them flaky), the new columns on a real run of the demo pair."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from mlx_dspark.cli import bench
from mlx_dspark.cli.measure import MODES, summarize, verdict
from mlx_dspark.stats import Stats

N = 3          # drafts per round
TOKENS = 64    # decoded tokens per run (the first token comes from the prefill)


def serial_run(rate: float) -> Stats:
    return Stats(requested="off", generated=TOKENS + 1, serial_steps=TOKENS,
                 t_serial=TOKENS / rate, prompt_tokens=12, t_prefill=0.02,
                 peak_memory_gb=0.5, tested_by_position=[0] * N, accepted_by_position=[0] * N)


def speculative_run(rate: float) -> Stats:
    """32 rounds of two tokens each, the round's time split between its parts."""
    t = TOKENS / rate
    return Stats(requested="on", mode="speculative", generated=TOKENS + 1, rounds=32,
                 t_round=t, t_draft=0.4 * t, t_verify=0.5 * t, t_rollback=0.05 * t,
                 drafted=96, accepted=32, prompt_tokens=12, t_prefill=0.025, peak_memory_gb=0.6,
                 tested_by_position=[32, 16, 8], accepted_by_position=[24, 6, 2])


def runs(serial: list[float], speculative: list[float], auto=None) -> dict:
    """mode -> per repeat, one prompt's Stats; "auto" decodes serially unless given runs."""
    auto = auto or [serial_run(r) for r in serial]
    return {"serial": [[serial_run(r)] for r in serial],
            "speculative": [[speculative_run(r)] for r in speculative],
            "auto": [[a] for a in auto]}


def report(r: dict) -> dict:
    summary = {"prompts": 1, "same_tokens": 1, **summarize(r, N)}
    return {"model": "a target", "drafter": "a drafter",
            "machine": {"system": "Linux", "machine": "x86_64", "cpu_count": 2, "mlx": "0",
                        "device": "cpu"},
            "settings": {"max_tokens": TOKENS, "num_draft": N, "repeats": len(r["serial"]),
                         "temperature": 0.0, "top_p": 1.0, "sampling": "rejection",
                         "dtype": "float32"},
            "prompts": [], "domains": {"code": summary}, "overall": summary,
            "bandwidth": {"weight_bytes_per_token": 1e6, "serial_gb_per_s": 0.1,
                          "memcpy_gb_per_s": 5.0}}


NOISE = "within noise: speculative against serial ranged"


def test_ratios_whose_spread_covers_the_difference_are_noise():
    assert verdict([1.17, 0.89, 1.03]) == "within noise"     # the two runs and one more
    assert verdict([1.10, 1.02, 1.04]) == "faster"           # every repeat faster, by little
    assert verdict([0.66, 0.31, 0.67]) == "slower"           # issue 41: was "within noise"
    assert verdict([1.0, 1.3, 1.2]) == "within noise"        # one repeat no faster
    assert verdict([1.20, 1.21, 1.19]) == "faster"
    assert verdict([0.46, 0.47, 0.45]) == "slower"
    assert verdict([1.17]) == "one repeat"                   # no spread: no verdict either way


def test_a_noisy_run_names_no_winner_in_json_and_table():
    r = report(runs(serial=[100, 100, 100], speculative=[117, 89, 103]))
    o = r["overall"]
    assert o["verdict"]["speculative"] == "within noise"
    assert o["speedup"] == pytest.approx(1.03)                # the median of the paired ratios
    assert o["spread"]["speedup"] == pytest.approx([0.89, 1.17])
    assert o["spread"]["kind"] == "min-max over the repeats" and o["spread"]["repeats"] == 3
    assert o["auto_picked_faster"] is None                    # no faster mode to pick
    text = bench.table(r)
    assert NOISE in text and "faster than serial" not in text
    assert "1.03x [0.89–1.17]" in text
    assert "the median of 3 repeats [min-max over the repeats]" in text
    assert json.loads(json.dumps(r))["overall"]["verdict"] == o["verdict"]


def test_a_real_difference_is_named_even_while_the_machine_drifts():
    # the machine slows down through the run; interleaved, each repeat's ratio stays 1.2
    r = report(runs(serial=[100, 80, 60], speculative=[120, 96, 72]))
    o = r["overall"]
    assert o["verdict"]["speculative"] == "faster"
    assert o["spread"]["tokens_per_s"]["serial"] == pytest.approx([60, 100])
    assert o["speedup"] == pytest.approx(1.2)
    assert o["spread"]["speedup"] == pytest.approx([1.2, 1.2])
    text = bench.table(r)
    assert "speculative is faster than serial in every repeat (1.20x–1.20x)" in text \
        and NOISE not in text


def test_slower_in_every_repeat_is_slower_with_its_range_never_noise():
    """Issue 41: ``0.66x [0.31–0.67] within noise`` when every repeat was slower."""
    r = report(runs(serial=[100, 100, 100], speculative=[66, 31, 67]))
    assert r["overall"]["verdict"]["speculative"] == "slower"
    text = bench.table(r)
    assert "speculative vs serial: 0.66x [0.31–0.67], speculative is slower than serial in " \
           "every repeat (0.31x–0.67x)" in text
    assert re.search(r"0\.66x \[0\.31–0\.67\] +slower", text)         # the table's row


def test_every_figure_has_its_spread():
    o = report(runs(serial=[100, 90, 110], speculative=[50, 45, 56]))["overall"]
    sp = o["spread"]
    for key in ("speedup", "auto_vs_serial", "efficiency", "predicted_speedup", "serial_step_ms"):
        assert sp[key][0] <= o[key] <= sp[key][1], key
    for key in ("tokens_per_s", "prefill_tokens_per_s", "ttft_ms", "peak_memory_gb"):
        assert set(o[key]) == set(MODES)
        for m in MODES:
            assert sp[key][m][0] <= o[key][m] <= sp[key][m][1], (key, m)
    assert sp["tokens_per_s"]["serial"] == pytest.approx([90, 110])


def test_auto_that_ran_serially_says_so_and_never_that_it_picked_the_faster_mode():
    # the run: auto decoded serially, faster than serial by noise alone
    r = report(runs(serial=[100, 100, 100], speculative=[117, 89, 103],
                    auto=[serial_run(r) for r in (117, 95, 100)]))
    text = bench.table(r)
    assert "picked the faster mode" not in text
    assert "auto: 100% of its 192 tokens from serial steps, 0% from speculative rounds (none)" \
        in text
    assert "auto ran only serial, and serial and speculative are within noise here: neither " \
           "is the faster mode" in text
    assert "within noise: auto against serial ranged 0.95x–1.17x over the repeats, 1.0 " \
           "included" in text


def test_auto_that_ran_serially_while_speculation_was_faster_says_that():
    auto = [serial_run(100) for _ in range(3)]
    auto[0].rounds, auto[0].probe_rounds, auto[0].switches = 2, 2, 1   # two probes, then serial
    auto[0].serial_steps -= 4
    r = report(runs(serial=[100, 101, 99], speculative=[150, 149, 152], auto=auto))
    o = r["overall"]
    assert o["auto_picked_faster"] is False
    assert o["auto_did"] == {"tokens": 192, "rounds": 2, "probe_rounds": 2, "serial_steps": 188,
                             "switches": 1, "generations": 3}
    lines = bench.auto_lines(o)
    assert lines[0] == ("auto: 98% of its 192 tokens from serial steps, 2% from speculative "
                        "rounds (2 rounds, 2 of them probes), 1 switch in 3 generations")
    assert lines[1].startswith("auto ran mostly serial, while speculative was the faster mode "
                               "in this run")
    # and when serial was the faster one, running serially is named as the right choice
    r = report(runs(serial=[100, 101, 99], speculative=[50, 49, 52]))
    assert r["overall"]["auto_picked_faster"] is True
    assert bench.auto_lines(r["overall"])[1].startswith(
        "auto ran only serial, the faster mode in this run")


# ---------------------------------------------------------------------------------------------
# on the demo pair: the new columns measured for real


@pytest.fixture(scope="module")
def demo_report():
    import mlx_dspark as md
    pair = md.load()
    args = argparse.Namespace(max_tokens=8, repeats=3, temp=0.0, top_p=1.0, sampling="rejection",
                              num_draft=3)
    prompts = [("code", bench.PROMPTS["code"][0]), ("chat", bench.PROMPTS["chat"][0])]
    r = bench.measure(pair, prompts, args)
    r["model"], r["drafter"] = "embedded demo target", "embedded demo drafter"
    return json.loads(json.dumps(r))                 # what --json prints


def test_prefill_first_token_and_peak_memory_are_measured_per_mode(demo_report):
    r = demo_report
    weights = r["bandwidth"]["weight_bytes_per_token"] / 1e9
    for s in [*r["prompts"], *r["domains"].values(), r["overall"]]:
        for m in MODES:
            assert s["prefill_tokens_per_s"][m] > 0 and s["ttft_ms"][m] > 0
            # MLX's peak holds at least the weights a step reads, and a small pair is small
            assert weights < s["peak_memory_gb"][m] < 2.0
        assert s["verdict"]["speculative"] in ("faster", "slower", "within noise")
        assert s["spread"]["repeats"] == 3
    for row in r["prompts"]:
        for m in MODES:            # one prompt, odd repeats: the median repeat is the same run
            assert row["ttft_ms"][m] * row["prefill_tokens_per_s"][m] / 1e3 == \
                pytest.approx(row["prompt_tokens"])
    text = bench.table(r)
    for word in ("prefill", "first token", "peak memory", "serial", "speculative", "auto"):
        assert word in text
