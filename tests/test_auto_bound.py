"""``num_draft="auto"`` never does more than 5 % worse than the best fixed draft length, on the
demo pair, with the round costs this machine measured with stock BLAS and with OpenBLAS
preloaded (tests/fixtures/auto_curves.json, written by benchmarks/auto_curves.py). Each round is
priced by that curve instead of the clock (testkit.modelled), so the comparison is
exact and repeatable and tests the choice itself: the acceptance estimates a request starts
from nothing, the exploration rounds and the curve's load-time line. The wall-clock comparison
(benchmarks/bench_auto_length.py) spreads by 5 to 15 % from run to run on a shared machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlx_dspark as md
from mlx_dspark.cli.bench import PROMPTS, _ids
from testkit.modelled import against_best, rates

CURVES = json.loads((Path(__file__).parent / "fixtures" / "auto_curves.json").read_text())
BUILDS = ("stock", "openblas")
BOUND = 0.95


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dspark", "mtp", "eagle3", "dflash"])
def test_auto_is_within_five_percent_of_the_best_fixed_length_on_this_machines_costs(name):
    pair = md.load(drafter=name)
    prompts = [_ids(pair, domain, text) for domain in PROMPTS for text in PROMPTS[domain][:2]]
    got = rates(pair, prompts, {build: CURVES[build][name] for build in BUILDS})
    for build in BUILDS:
        assert against_best(got[build])[1] >= BOUND, (build, got[build])
