"""The break-even controller: its policy on simulated costs and acceptance (exact, no clock),
then "auto" on the real loop with a useless drafter and with the oracle drafter (fixed costs
in place of wall times, so the load on the machine cannot change the outcome)."""

import numpy as np

from testkit.loop_helpers import FixedCosts, serial_greedy
from mlx_dspark.policy import controller as C
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter, tiny_target


def simulate(steps, alpha, t_serial=1.0, t_round=1.5, n=3, seed=0):
    """Run the controller for ``steps`` decisions; ``alpha(step)`` is the true conditional
    acceptance. Returns the controller and, per step, whether it speculated."""
    rng = np.random.default_rng(seed)
    c, kinds = C.Controller(n), []
    for i in range(steps):
        spec = c.speculate_next()
        kinds.append(spec)
        if spec:
            a = 0
            while a < n and rng.random() < alpha(i):
                a += 1
            c.observe_round(t_round, n, num_tested=min(a + 1, n), num_accepted=a)
        else:
            c.observe_serial(t_serial)
    return c, np.array(kinds)


def test_a_useless_drafter_ends_serial_and_probes_ever_more_rarely():
    c, kinds = simulate(2000, lambda i: 0.0)
    assert not c.speculating
    assert kinds[-1000:].sum() <= 1000 // C.PROBE_MAX + 1
    # the probes' extra cost over pure serial decoding: a few percent at most
    extra = kinds.sum() * (1.5 - 1.0) / 2000
    assert extra < 0.02


def test_a_good_drafter_keeps_speculating_apart_from_cost_refreshes():
    c, kinds = simulate(1000, lambda i: 0.8)
    assert c.speculating and c.switches == 0
    assert kinds.mean() > 1 - 2 / C.REFRESH


def test_acceptance_worth_less_than_the_round_cost_is_not_speculated():
    # alpha 0.3 at N=3: E = 1.42 tokens per round, rounds cost 1.5 steps -> serial wins
    c, _ = simulate(1000, lambda i: 0.3)
    assert not c.speculating


def test_content_change_switches_speculation_back_on_and_off():
    c, kinds = simulate(1200, lambda i: 0.0 if i < 400 else 0.9)
    assert not kinds[300:400].any() or kinds[300:400].mean() < 0.05
    assert c.speculating and kinds[-200:].mean() > 1 - 2 / C.REFRESH
    assert c.switches >= 2
    on_at = 400 + int(np.argmax(kinds[400:] & np.roll(kinds[400:], -1)))
    assert on_at < 400 + 2 * C.PROBE_MAX          # found within two probes
    c2, kinds2 = simulate(800, lambda i: 0.9 if i < 400 else 0.0)
    assert not c2.speculating and kinds2[-200:].mean() < 0.05


def test_hysteresis_holds_the_mode_between_the_thresholds():
    c = C.Controller(3)
    c.serial_times, c.round_ratios = [1.0] * C.MIN_SAMPLES, [1.0] * C.MIN_SAMPLES
    c.tested, c.accepted = [100.0] * 3, [0.0] * 3
    c.accepted[0] = 2.0                            # alpha_1 ~ 0.025: E ~ 1.03 tokens per round
    assert C.OFF < c.predicted_speedup() < C.ON
    c.observe_round(1.0, 3, 1, 0)                  # speculating: stays on
    assert c.speculating
    c.speculating = False
    c.observe_round(1.0, 3, 1, 0)                  # a probe: does not switch on
    assert not c.speculating


def test_forced_modes_ignore_the_estimates():
    for mode in ("on", "off"):
        c = C.Controller(3, mode=mode)
        for _ in range(20):
            c.observe_round(10.0, 3, 1, 0)
            c.observe_serial(1.0)
            assert c.speculate_next() is (mode == "on")


# --- on the real loop (tiny fp32 target; decisions come from measured wall times)


PROMPT = [3, 14, 15, 92, 65]


def auto(target, drafter, max_tokens, num_draft, round_cost, stats):
    session = Session(target, drafter)
    session.controller = FixedCosts(num_draft, round_cost)
    return list(decode(session, Request(PROMPT, max_tokens=max_tokens, num_draft=num_draft),
                       stats))


def test_auto_with_a_random_weight_drafter_ends_serial():
    target = tiny_target(seed=2)
    stats = Stats()
    out = auto(target, random_drafter(target), 120, 3, 2.0, stats)
    assert out == serial_greedy(target, PROMPT, 120)
    # the warm-up round, then probes every 16, 32, 64 serial steps
    assert stats.mode == "serial" and stats.switches == 1 and stats.rounds <= 4


def test_auto_with_an_oracle_drafter_speculates_and_follows_a_content_change(monkeypatch):
    target = tiny_target(seed=2)
    ref = serial_greedy(target, PROMPT, 200)
    good = Stats()
    auto(target, OracleDrafter(PROMPT + ref, 97, 0.95), 200, 3, 2.0, good)
    # Rounds (2 steps, ~3.7 tokens) pay: only the cost refreshes are serial.
    assert good.switches == 0 and good.serial_steps <= good.rounds / C.REFRESH + 2
    # Useless for the first 30 tokens, then perfect: auto must turn speculation back on.
    # With N = 7 and a round costing 3 steps, a useless round loses (1 token) and a perfect
    # one wins (8 tokens). Probes may take 10% of serial time here (2% by default) so that
    # they come often enough for this short run.
    monkeypatch.setattr(C, "PROBE_BUDGET", 0.1)
    change = len(PROMPT) + 30
    drafter = OracleDrafter(PROMPT + ref, 97, lambda pos: 0.0 if pos < change else 1.0)
    stats = Stats()
    out = auto(target, drafter, 200, 7, 3.0, stats)
    assert out == ref
    # off during the useless stretch, back on after the change, and on at the end
    assert stats.switches >= 2 and stats.mode == "speculative"


def test_when_even_perfect_rounds_cannot_pay_probes_come_only_every_probe_max_steps():
    # N=3 emits at most 4 tokens a round; a round costing 5 serial steps can never win,
    # however good the drafter: probes are then only cost re-measurements.
    c, kinds = simulate(3000, lambda i: 1.0, t_round=5.0)
    assert c.ceiling() < C.OFF and not c.speculating
    assert kinds[-2000:].sum() <= 2000 // C.PROBE_MAX + 1
    # the same perfect drafter at an affordable round cost keeps speculating
    c2, _ = simulate(3000, lambda i: 1.0, t_round=3.0)
    assert c2.ceiling() > C.OFF and c2.speculating


def test_probes_stay_within_budget_when_a_round_costs_many_serial_steps():
    # On MLX's CPU backend a round costs ~8 serial steps; one probe per PROBE_MAX steps
    # would then lose ~3 % of serial time. Probes are spaced by what the budget allows.
    c, kinds = simulate(6000, lambda i: 0.0, t_round=12.0)
    assert c.ceiling() < C.OFF and not c.speculating
    probes = kinds[-4000:].sum()
    assert probes * (12.0 - 1.0) / 4000 <= 1.25 * C.REMEASURE_BUDGET
    assert probes >= 1                                  # it still re-measures the cost


def test_a_probes_catch_up_counts_against_the_budget_when_no_round_can_pay():
    # A round of 12 serial steps can never pay; a probe after a long serial stretch also
    # pays the drafter's catch-up (here 6 serial steps' worth). Both fit in the budget.
    plain, caught = C.Controller(3), C.Controller(3)
    for c, catchup in ((plain, 0.0), (caught, 6.0)):
        c.observe_serial(1.0)
        c.observe_catchup(catchup, 300)
        c.observe_round(12.0, 3, 1, 0)
        assert not c.speculating and c.ceiling() < C.OFF
        loss = 12.0 - c.expected_tokens() + catchup
        assert loss / c.probe_every <= C.REMEASURE_BUDGET
    assert caught.probe_every > plain.probe_every > C.PROBE_MAX


def test_a_drafter_catch_up_dearer_than_the_probe_budget_spaces_probes_to_probe_max():
    # A probe after k serial steps also pays the drafter's catch-up on those k tokens: when
    # that alone costs more than PROBE_BUDGET of each step, no probe interval is affordable.
    dear, cheap = C.Controller(3), C.Controller(3)
    for c, per_token in ((dear, 0.05), (cheap, 0.0)):
        c.observe_serial(1.0)
        c.observe_catchup(per_token * 10, 10)
        c.observe_round(2.0, 3, 1, 0)              # an affordable round that accepted nothing
        assert not c.speculating
    assert dear.probe_every == C.PROBE_MAX
    assert C.PROBE_MIN <= cheap.probe_every < C.PROBE_MAX
