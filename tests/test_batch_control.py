"""The controller follows batch size (issue 34 item 3, decode/batch_control.py): rows that
leave it to "auto" speculate together when their expected tokens pay for a batched round at
the live batch size, and step serially together when they do not; at batch 1 a row decides
as alone. Costs are fixed per size (loop_helpers.FixedBatchCosts), so the machine's load
cannot decide; the tokens stay each request's alone whatever is decided."""

import pytest

from testkit.loop_helpers import FixedBatchCosts, FixedCosts, serial_greedy
from mlx_dspark.policy import controller as C
from mlx_dspark.decode.batch import Batch
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request
from mlx_dspark.stats import Stats, format_mode
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import tiny_target

PROMPTS = [[3, 14, 15, 92, 65], [2, 71, 82, 81], [1, 41, 42, 13, 56, 23], [16, 18]]
TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=2)


@pytest.fixture(scope="module")
def alone(target):
    return [serial_greedy(target, p, TOKENS) for p in PROMPTS]


def oracle(prompt, reference, acceptance):
    return OracleDrafter(prompt + reference, 97, acceptance)


def decode_together(batch, sessions, requests):
    rows = [batch.add(s, r) for s, r in zip(sessions, requests)]
    out = {id(row): list(row.tokens) for row in rows}
    while batch.rows:
        for row in batch.step():
            out[id(row)] += row.tokens
    return [out[id(row)] for row in rows], [row.stats for row in rows]


# E = 1 + .9 + .81 + .729 = 3.44 tokens a round at N = 3: a round of 1.5 batched serial steps
# pays (2.3x), one of 6 cannot (at most 4 tokens). Each table makes the other size pay, so
# the decision follows the cost at the live size, not the size itself.
@pytest.mark.parametrize("round_cost", [{2: 1.5, 4: 6.0}, {2: 6.0, 4: 1.5}])
@pytest.mark.parametrize("size", [2, 4])
def test_a_batch_speculates_at_a_size_where_a_round_pays_and_steps_serially_where_not(
        target, alone, round_cost, size):
    batch = Batch()
    batch.control = FixedBatchCosts(round_cost)
    sessions = [Session(target, oracle(p, ref, 0.9)) for p, ref in zip(PROMPTS, alone)]
    requests = [Request(p, max_tokens=TOKENS, num_draft=3) for p in PROMPTS[:size]]
    # a row forced on rides along: it speculates by its own request, whatever the batch does
    forced = Request(PROMPTS[0], max_tokens=TOKENS, num_draft=3, speculative="on")
    got, stats = decode_together(batch, sessions[:size] + [Session(target, oracle(
        PROMPTS[0], alone[0], 0.9))], requests + [forced])
    assert got == alone[:size] + [alone[0]]
    pays = round_cost[size] < 4
    for s in stats[:size]:
        assert s.batch == size
        if pays:    # the warm-up round is the one probe; only cost refreshes are serial
            assert s.mode == "speculative" and s.switches == 0 and s.probe_rounds == 1
            assert s.predicted_speedup > C.ON and s.serial_steps <= s.rounds / C.REFRESH + 2
        else:       # the warm-up probe switched it off; no probe comes back within 40 tokens
            assert s.mode == "serial" and s.switches == 1
            assert s.rounds == s.probe_rounds == 1 and s.predicted_speedup < C.OFF
            assert f"at batch {size}, break-even 1.00, so serial" in format_mode(s)
    on = stats[-1]
    assert on.batch == 1 and on.serial_steps == 0 and on.probe_rounds == 0 and on.rounds > 0


def test_at_batch_1_a_row_decides_and_counts_exactly_as_alone(target, alone, monkeypatch):
    # useless for the first 12 tokens, then perfect: off, probes, back on (as the controller
    # test's content change), on fixed costs of the row's own controller
    monkeypatch.setattr(C, "PROBE_BUDGET", 0.1)
    change = len(PROMPTS[0]) + 12
    ref = serial_greedy(target, PROMPTS[0], 160)
    request = Request(PROMPTS[0], max_tokens=160, num_draft=7)
    runs = []
    for together in (False, True):
        session = Session(target, oracle(PROMPTS[0], ref,
                                         lambda p: 0.0 if p < change else 1.0))
        session.controller = FixedCosts(7, 3.0)
        stats = Stats()
        if together:
            batch = Batch()
            batch.control = FixedBatchCosts({})     # a size it asked for would raise
            (tokens,), (stats,) = decode_together(batch, [session], [request])
        else:
            tokens = list(decode(session, request, stats))
        runs.append((tokens, stats.as_dict()))
    (tokens, want), (got_tokens, got) = runs
    assert got_tokens == tokens == ref
    assert want["mode_switches"] >= 2 and want["probe_rounds"] >= 2    # it did decide
    keep = ("time", "tokens_per_s", "prompt_tokens_per_s")
    assert {k: v for k, v in got.items() if k not in keep} == \
        {k: v for k, v in want.items() if k not in keep}
