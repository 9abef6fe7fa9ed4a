"""benchmarks/bench_batching_servers.py reports what its waves measured: per
stream count the medians of aggregate tokens/s together and in turn, the ratio as the median
of per-round ratios with their range, TTFTs, and the together rate over the reference
server's. Checked on constructed waves (no server, no mlx-lm: the bench itself stays out of
the suite's runtime)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_batching_servers.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_batching_servers", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wave(tok_s, ttft, tokens=8):
    return dict(tok_s=tok_s, ttft=ttft, tokens=[tokens] * len(ttft), texts={})


def rounds(together, in_turn, n):
    """One round per pair of rates, TTFTs growing with the stream index."""
    return [dict(together=wave(t, [0.1 * (i + 1) for i in range(n)]),
                 in_turn=wave(s, [0.05] * n)) for t, s in zip(together, in_turn)]


def test_the_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians():
    b = bench()
    # per-round ratios 3, 1, 2 -> median 2; the ratio of medians would be 200/150
    ratio, spread = b.ratio_spread([300, 100, 200], [100, 100, 100])
    assert ratio == 2 and spread == [1, 3]
    ratio, _ = b.ratio_spread([300, 200, 100], [100, 200, 150])
    assert ratio == 1


def test_rows_hold_medians_ttfts_and_the_rate_over_the_reference():
    b = bench()
    # per-round ratios at 4 streams: 2, 2, 2.5
    waves = {1: rounds([100, 110, 90], [100, 100, 100], 1),
             4: rounds([200, 300, 250], [100, 150, 100], 4)}
    rows = b.summarize("ours", waves, reference_tok_s={1: 50.0, 4: 500.0})
    one, four = rows
    assert (one["streams"], one["together_tok_s"], one["in_turn_tok_s"]) == (1, 100, 100)
    assert four["together_tok_s"] == 250 and four["in_turn_tok_s"] == 100
    assert four["together_over_in_turn"] == 2 and four["spread"] == [2, 2.5]
    assert round(four["ttft_together_median"], 6) == 0.25      # median of 0.1..0.4
    assert round(four["ttft_together_max"], 6) == 0.4
    assert four["ttft_in_turn_median"] == 0.05
    assert one["together_over_reference"] == 2 and four["together_over_reference"] == 0.5
    assert four["tokens"] == [8]
    table = b.table(rows, "theirs")
    assert "| ours | 4 | 250.0 | 100.0 | 2.00× [2.00-2.50] | 0.250 / 0.400 | 0.050 | 0.50× |" \
        in table.splitlines()
    assert "together / theirs together" in table.splitlines()[0]


def test_every_wave_of_every_round_gets_prompts_no_other_wave_has():
    b = bench()
    sets = b.prompt_sets(3)
    prompts = [p for r in sets for n in b.STREAMS for mode in ("together", "in_turn")
               for p in r[n][mode]]
    assert len(prompts) == 3 * 2 * sum(b.STREAMS) == len(set(prompts))
    assert all(len(sets[0][n]["together"]) == n for n in b.STREAMS)
