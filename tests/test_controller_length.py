"""``num_draft="auto"``: each round's draft length is the argmax of expected tokens per unit of
cost (decode/length.py). The choice itself against a float64 NumPy brute force and hand-worked
cases; the acceptance estimates from accepted counts; the cost curve refreshed by rounds; then
on the real loop: greedy output equals serial with every drafter whatever lengths are chosen,
and the lengths follow the drafter's acceptance and the machine's cost curve."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mlx_dspark as md
from testkit.loop_helpers import serial_greedy
from mlx_dspark.policy import controller as C, length as L
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.drafters import KINDS
from mlx_dspark.request import Request, RequestError
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter, random_eagle3, random_mtp, tiny_target


# --- the choice (no clock)


def brute_force(alpha, cost) -> tuple[int, float]:
    """Tokens per unit of cost for every length, in float64, written from the definition:
    E(n) = 1 + sum_{j<=n} prod_{i<=j} alpha_i."""
    a = np.asarray(alpha, np.float64)
    e = 1.0 + np.cumsum(np.cumprod(a))
    rate = e / np.asarray(cost, np.float64)
    n = int(np.argmax(rate))          # the first maximum: the shortest on a tie
    return n + 1, float(rate[n])


def test_expected_tokens_add_the_running_products_of_acceptance():
    assert L.expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert L.expected_tokens([0.9, 0.5, 0.2], 1) == pytest.approx(1.9)


def test_the_chosen_length_maximises_expected_tokens_per_unit_of_cost():
    # E = 1.9, 2.62, 2.98 over costs 1.2, 1.3, 2.5: 1.58, 2.02, 1.19 tokens per step
    n, rate = L.best_length([0.9, 0.8, 0.5], [1.2, 1.3, 2.5])
    assert n == 2 and rate == pytest.approx(2.62 / 1.3)
    rng = np.random.default_rng(0)
    for _ in range(500):
        k = int(rng.integers(1, 8))
        alpha = rng.uniform(0, 1, k).tolist()
        cost = np.cumsum(rng.uniform(0.05, 1.5, k)).tolist()     # dearer with every draft
        n, rate = L.best_length(alpha, cost)
        want = brute_force(alpha, cost)
        assert n == want[0] and rate == pytest.approx(want[1], rel=1e-12)


def test_a_flat_verify_drafts_far_and_a_steep_one_drafts_one():
    good = [0.9] * 7
    assert L.best_length(good, [1.0 + 0.03 * n for n in range(1, 8)])[0] == 7   # a Mac
    assert L.best_length(good, [1.0 + n for n in range(1, 8)])[0] == 1   # stock BLAS here
    assert L.best_length([0.0] * 7, [1.0] * 7)[0] == 1           # a tie: the shortest


def test_acceptance_estimates_update_from_accepted_counts():
    c = C.Controller(3, curve=L.Curve([1.0, 1.0, 1.0]))
    assert c.alpha() == pytest.approx([0.5, 0.5, 0.5])                # the prior
    c.observe_round(1.0, 3, num_tested=3, num_accepted=2)             # d1, d2 kept, d3 not
    a1 = (1 + 0.25) / 1.5
    a2 = (1 + 0.5 * a1) / 1.5
    a3 = (0 + 0.5 * a2) / 1.5
    assert c.alpha() == pytest.approx([a1, a2, a3])
    c.observe_round(1.0, 1, num_tested=1, num_accepted=0)             # a length-1 round
    f = C.DECAY                                                       # (aged per token)
    b1 = (f * 1 + 0.25) / (f * 1 + 1 + 0.5)
    b2 = (f * 1 + 0.5 * b1) / (f * 1 + 0.5)
    b3 = (0 + 0.5 * b2) / (f * 1 + 0.5)
    assert c.alpha() == pytest.approx([b1, b2, b3])


def test_a_position_never_tested_counts_as_the_one_before_it():
    c = C.Controller(4, curve=L.Curve([1.0] * 4))
    c.tested, c.accepted = [40.0, 40.0, 0.0, 0.0], [36.0, 32.0, 0.0, 0.0]
    a = c.alpha()
    assert a[0] == pytest.approx(36.25 / 40.5)
    assert a[2] == pytest.approx(a[1]) and a[3] == pytest.approx(a[1])


def test_the_length_follows_the_acceptance_on_a_flat_curve():
    c = C.Controller(7, curve=L.Curve([1.0 + 0.05 * n for n in range(1, 8)]))
    c.observe_serial(1.0)
    for _ in range(30):                                 # every draft accepted
        n = c.length()
        c.observe_round(1.0 + 0.05 * n, n, num_tested=n, num_accepted=n)
    assert c.best() == 7
    for _ in range(30):                                 # the first draft rejected every time
        n = c.length()
        c.observe_round(1.0 + 0.05 * n, n, num_tested=1, num_accepted=0)
    assert c.best() == 1


def test_rounds_refresh_the_cost_curve_at_their_length_and_move_the_rest():
    curve = L.Curve([1.0, 2.0, 3.0, 4.0])
    assert [curve.cost(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    c = C.Controller(4, curve=curve)
    c.observe_serial(0.5)
    c.observe_round(1.0, 1, num_tested=1, num_accepted=1)     # 1.0 s / 0.5 s: 2 steps
    assert curve.measured(1) == [2.0]
    assert [curve.cost(n) for n in (1, 2, 3, 4)] == [2.0, 3.0, 4.0, 5.0]   # a round's overhead
    for ratio in (3.5, 9.0, 3.5):                   # a spike: medians do not chase it
        curve.observe(2, ratio)
    curve.observe(3, 3.3)
    # lengths run: their own medians; length 4: 4 plus the median of 2-1, 3.5-2, 3.3-3
    assert [curve.cost(n) for n in (1, 2, 3)] == [2.0, 3.5, 3.3]
    assert curve.cost(4) == pytest.approx(4.0 + 1.0)


def test_a_length_measured_long_ago_takes_the_price_of_the_lengths_run_lately():
    # a block drafter's curve (the block at every length, +0.5 a verified draft): every length
    # measured once early on, then the context grows and the rounds run (length 1) cost 1 more
    curve = L.Curve([3.0, 3.5, 4.0, 4.5])
    for n in (1, 2, 3, 4):
        curve.observe(n, 2.5 + 0.5 * n)
    alpha = [0.5, 0.3, 0.3, 0.3]
    for _ in range(L.FRESH - 3):        # FRESH + 1 rounds in all: length 2's is FRESH - 1 old
        curve.observe(1, 4.0)
    # still fresh, length 2's early price makes it look cheaper than it is: it would be chosen
    assert curve.costs() == [4.0, 3.5, 4.0, 4.5] and L.best_length(alpha, curve.costs())[0] == 2
    for _ in range(3):                  # lengths 2, 3 and 4's measurements FRESH rounds old
        curve.observe(1, 4.0)
    # now stale: the curve moves with the length run, and one draft is the better round
    assert curve.costs() == [4.0, 4.5, 5.0, 5.5]
    assert L.best_length(alpha, curve.costs()) == brute_force(alpha, curve.costs())
    assert L.best_length(alpha, curve.costs())[0] == 1


def test_the_load_time_curve_is_the_least_squares_line_and_never_falls():
    # DFlash's calibration on this CPU: a block drafter's steps are small next to the noise
    raw = [2.99, 3.2, 3.71, 4.27, 3.73, 4.01, 4.57]
    slope, intercept = np.polyfit(np.arange(1, 8), raw, 1)
    assert L.line(raw) == pytest.approx(list(intercept + slope * np.arange(1, 8)))
    assert all(b > a for a, b in zip(L.line(raw), L.line(raw)[1:]))
    assert L.line([1.0, 1.5, 2.0]) == pytest.approx([1.0, 1.5, 2.0])   # a line stays itself
    assert L.line([3.0, 2.0, 1.0]) == pytest.approx([2.0] * 3)         # a falling one: flat
    assert L.line([2.5]) == [2.5]


def test_a_spike_at_the_long_end_never_prices_a_short_round_at_nothing_or_less():
    # one length's rounds timed while the machine was busy (load average 6 on 2 cores): the
    # least-squares line through them crosses zero at one draft
    raw = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 20.0]
    assert np.polyval(np.polyfit(np.arange(1, 8), raw, 1), 1) < 0
    loaded = L.line(raw)
    assert min(loaded) == 1.0 and all(b >= a for a, b in zip(loaded, loaded[1:]))
    # a fresh median far below the load-time curve: the lengths it moves stay above the least
    # cost measured
    curve = L.Curve([2.0, 2.5, 9.0])
    curve.observe(3, 0.5)
    assert curve.costs() == [0.5, 0.5, 0.5]


class Clock:
    """``time.perf_counter`` as a test sets it: each reading ``step`` seconds after the last
    (0: a clock that stands still, as a coarse one does over short work; below 0: one that
    steps back)."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("step", [0.0, -1e-3], ids=["still", "back"])
@pytest.mark.parametrize("mode", ["on", "auto"])
def test_no_cost_is_ever_non_positive_whatever_the_clock_reads(target, monkeypatch, step, mode):
    """Every cost is a difference of clock readings: with differences of zero or less the
    round costs, the serial step, the curve measured at load and refreshed by the rounds all
    stay positive, and the output is still serial greedy's."""
    monkeypatch.setattr(time, "perf_counter", Clock(step))
    drafter = random_mtp(target, seed=2)
    session = Session(target, drafter)
    prompt = PROMPTS[1]
    out = list(decode(session, Request(prompt, max_tokens=24, num_draft="auto",
                                       speculative=mode)))
    monkeypatch.undo()
    assert out == serial_greedy(target, prompt, 24)
    curve = drafter._auto_curve
    assert curve.step > 0 and min(curve.loaded) > 0 and min(curve.costs()) > 0
    assert curve.seen and min(r for seen in curve.seen.values() for _, r in seen) > 0
    if mode == "auto":      # (a forced call's controller is its own, not kept)
        control = session.controller
        assert control.serial_times and min(control.serial_times + control.round_ratios) > 0


def test_every_explore_th_round_drafts_one_more_and_corrects_an_over_priced_curve(monkeypatch):
    def run(rounds):
        # the load-time curve over-prices lengths 2 and 3; rounds really cost 1 + 0.05 n
        c = C.Controller(3, curve=L.Curve([1.0, 3.0, 3.0]))
        c.observe_serial(1.0)
        lengths = []
        for _ in range(rounds):
            n = c.length()
            lengths.append(n)
            c.observe_round(1.0 + 0.05 * n, n, num_tested=n, num_accepted=n)
        return c, lengths

    c, lengths = run(64)
    assert lengths[:15] == [1] * 15 and lengths[15] == 2      # the 16th round explores
    assert c.best() == 3 and lengths[-1] == 3
    monkeypatch.setattr(C, "EXPLORE", 10 ** 9)
    c, lengths = run(64)
    assert set(lengths) == {1} and c.best() == 1               # without it: stuck at 1


def test_forced_on_without_serial_steps_rounds_are_priced_by_the_load_time_step():
    c = C.Controller(3, mode="on", curve=L.Curve([1.0, 2.0, 3.0], step=0.01))
    c.observe_round(0.05, 2, num_tested=2, num_accepted=1)          # 5 load-time steps
    assert c.curve.measured(2) == [pytest.approx(5.0)]
    c.observe_serial(0.025)                                         # a step timed: it counts
    c.observe_round(0.05, 2, num_tested=2, num_accepted=1)
    assert c.curve.measured(2)[-1] == pytest.approx(2.0)


def test_the_ceiling_is_the_best_perfect_round_on_the_curve():
    c = C.Controller(3, curve=L.Curve([2.0, 2.5, 5.0]))
    assert c.ceiling() == pytest.approx(3 / 2.5)


def test_num_draft_takes_auto_and_refuses_other_words():
    assert Request([1, 2], num_draft="auto").num_draft == "auto"
    with pytest.raises(RequestError) as e:
        Request([1, 2], num_draft="max")
    assert e.value.param == "num_draft" and "'auto'" in str(e.value)


# --- on the real loop


PROMPTS = [[3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2], list(range(1, 30))]
TOY_DRAFTERS = {"dspark": random_drafter, "mtp": lambda t: random_mtp(t, seed=2),
                "eagle3": lambda t: random_eagle3(t, seed=3)}


class Cycling(C.Controller):
    """Speculates every step, drafting 1, 2, .., longest, 1, .. tokens: every length, and
    every change of length, in one run."""

    def __init__(self, longest):
        super().__init__(longest, curve=L.Curve([1.0] * longest))
        self.lengths = []

    def speculate_next(self):
        return True

    def length(self):
        self.lengths.append(len(self.lengths) % self.num_draft + 1)
        return self.lengths[-1]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.mark.parametrize("kind", list(TOY_DRAFTERS))
def test_greedy_with_lengths_changing_every_round_equals_serial(target, kind):
    drafter = TOY_DRAFTERS[kind](target)
    for prompt in PROMPTS:
        session = Session(target, drafter)
        session.controller = control = Cycling(L.longest(drafter))
        stats = Stats()
        out = list(decode(session, Request(prompt, max_tokens=24, num_draft="auto"), stats))
        assert out == serial_greedy(target, prompt, 24)
        assert stats.rounds > 0 and len(set(control.lengths)) == L.longest(drafter)


@pytest.mark.parametrize("mode", ["on", "auto"])
@pytest.mark.parametrize("kind", list(TOY_DRAFTERS))
def test_greedy_auto_length_on_the_measured_curve_equals_serial(target, kind, mode):
    drafter = TOY_DRAFTERS[kind](target)
    for prompt in PROMPTS:
        out = list(decode(Session(target, drafter),
                          Request(prompt, max_tokens=24, num_draft="auto", speculative=mode)))
        assert out == serial_greedy(target, prompt, 24)
    curve = drafter._auto_curve              # measured once, kept on the drafter
    assert curve.step > 0 and curve.longest == L.longest(drafter)
    assert all(c > 0 for c in curve.loaded) and curve.seen      # refreshed by the rounds


class FlatCosts(C.Controller):
    """Speculates every step on a nearly flat cost curve (a Mac's economics), with the
    clock replaced by that curve: its lengths depend only on what the drafter accepts."""

    def __init__(self, longest):
        super().__init__(longest, curve=L.Curve([self.cost(n) for n in range(1, longest + 1)]))

    @staticmethod
    def cost(n):
        return 1.0 + 0.02 * n

    def speculate_next(self):
        return True

    def observe_serial(self, seconds):
        super().observe_serial(1.0)

    def observe_round(self, seconds, num_drafted, num_tested, num_accepted):
        super().observe_round(self.cost(num_drafted), num_drafted, num_tested, num_accepted)


def test_a_perfect_drafter_on_a_flat_curve_drafts_the_longest_and_a_useless_one_one(target):
    prompt = PROMPTS[0]
    ref = serial_greedy(target, prompt, 60)
    for acceptance in (1.0, 0.0):
        session = Session(target, OracleDrafter(prompt + ref, 97, acceptance))
        session.controller = FlatCosts(7)
        stats = Stats()
        out = list(decode(session, Request(prompt, max_tokens=60, num_draft="auto"), stats))
        assert out == ref
        if acceptance:       # one position more a round up to 7 (2 + 3 + ... + 8 = 35 tokens),
            # then 8 tokens a round, the last one cut short
            assert stats.rounds <= 7 + (60 - 35) // 8 + 1 and stats.accepted == stats.drafted
            assert stats.drafted >= sum(range(1, 8)) + 7 * (stats.rounds - 8)
        else:                # one draft a round, but for the explored rounds and the
            # second: one rejection seen, position 2 is still estimated as position 1, and
            # on a flat curve a second draft is nearly free
            assert stats.drafted <= stats.rounds + stats.rounds // C.EXPLORE + 1
            assert stats.rounds >= 50


DEMO_KINDS = [name for name, kind in KINDS.items() if kind.demo or not kind.architectures]


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMO_KINDS)
def test_every_demo_drafter_with_auto_length_gives_the_serial_text(name):
    pair = md.load(drafter=name, dtype="float32")
    for prompt in ("def fibonacci(n):\n", "Write a short poem about the sea."):
        serial = md.generate(pair, prompt, max_tokens=40, speculative=False)
        for mode in ("on", "auto"):
            spec = md.generate(pair, prompt, max_tokens=40, num_draft="auto", speculative=mode)
            assert spec.tokens == serial.tokens, (name, mode, prompt)


@pytest.mark.parametrize("kind", list(TOY_DRAFTERS))
def test_seeded_reproducible_sampling_with_changing_lengths_gives_the_serial_text(target, kind):
    # the reproducible scheme's text depends on the seed alone, never on the drafts
    drafter = TOY_DRAFTERS[kind](target)
    options = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, sampling="reproducible")
    for prompt in PROMPTS:
        serial = list(decode(Session(target), Request(prompt, speculative="off", **options)))
        session = Session(target, drafter)
        session.controller = Cycling(L.longest(drafter))
        assert list(decode(session, Request(prompt, num_draft="auto", **options))) == serial
