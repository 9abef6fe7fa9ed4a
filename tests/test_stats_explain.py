"""Stats that explain themselves (issue 25, item 6): an "auto" run that ended serial says so
and why (the predicted speedup against break-even), and rounds "auto" ran to measure are
counted and labelled as probes, so one probe's acceptance is not shown as the run's."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats, format_stats
from testkit.loop_helpers import FixedCosts
from testkit.oracle_drafter import OracleDrafter


def lines(stats: Stats) -> dict:
    return dict(line.split(": ", 1) for line in format_stats(stats))


def test_an_auto_run_that_ended_serial_says_why():
    s = Stats(requested="auto", mode="serial", switches=1, predicted_speedup=0.57, rounds=1,
              probe_rounds=1, serial_steps=36, drafted=3, accepted=2, generated=40,
              tested_by_position=[1, 1, 1], accepted_by_position=[1, 1, 0])
    got = lines(s)
    assert got["mode"] == ("serial (requested auto, 1 switches): speculation predicted at "
                           "0.57x serial speed, break-even 1.00, so serial")
    assert got["rounds"] == "0 speculative + 1 probe, 36 serial"
    assert got["mean accepted per round"] == "2.00 (probe round only)"
    assert got["acceptance by position"] == "1.00 1.00 0.00 (probe round only)"
    assert s.as_dict()["probe_rounds"] == 1


def test_forced_and_speculating_runs_read_as_before():
    s = Stats(requested="on", mode="speculative", rounds=18, generated=40, accepted=21,
              tested_by_position=[18, 11, 7], accepted_by_position=[11, 7, 3])
    got = lines(s)
    assert got["mode"] == "speculative (requested on, 0 switches)"
    assert got["rounds"] == "18 speculative, 0 serial"
    assert got["mean accepted per round"] == "1.17"


@pytest.fixture(scope="module")
def pair():
    return md.load()


def test_auto_with_a_useless_drafter_ends_serial_and_counts_its_rounds_as_probes(pair):
    # fixed costs (a round = 1.5 serial steps) so the machine's load cannot decide the mode
    ids = pair.tokenizer.encode("def fibonacci(n):\n")
    useless = OracleDrafter(ids, pair.target.config.vocab_size, acceptance=0.0,
                            inner=pair.drafter)
    session = Session(pair.target, useless)
    session.controller = FixedCosts(3, 1.5)
    stats = Stats()
    list(decode(session, Request(ids, max_tokens=200, num_draft=3), stats))
    assert stats.mode == "serial" and stats.predicted_speedup < 1.0
    assert stats.rounds >= 1 and stats.probe_rounds == stats.rounds
    text = "\n".join(format_stats(stats))
    assert ", so serial" in text and "(probe round" in text


def test_the_speedup_that_explains_serial_is_the_one_serial_was_decided_on():
    # after the last probe, serial steps age its evidence back toward the prior, so a
    # prediction recomputed at the end would read > 1 beside "so serial"
    c = FixedCosts(3, 1.5)
    c.observe_serial(1.0)
    c.observe_round(1.5, 3, num_tested=1, num_accepted=0)
    decided = c.decided
    assert not c.speculating and decided < 1.0
    for _ in range(100):
        c.observe_serial(1.0)
    assert c.predicted_speedup() > 1.0 > c.decided == decided


def test_rounds_of_a_forced_run_are_never_probes(pair):
    stats = Stats()
    ids = pair.tokenizer.encode("def fibonacci(n):\n")
    list(decode(Session(pair.target, pair.drafter), Request(ids, max_tokens=20,
                                                            speculative="on"), stats))
    assert stats.rounds > 0 and stats.probe_rounds == 0
