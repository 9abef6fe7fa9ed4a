"""The break-even controller (docs/design.md §8): speculate only while it is expected to win.

A speculative round with N drafts emits ``E = 1 + sum_{j<=N} prod_{i<=j} alpha_i`` tokens on
average and costs ``t_round``; a serial step emits one token and costs ``t_serial``. The
controller keeps online estimates of the per-position conditional acceptance ``alpha_i`` and of
the round's cost *relative to a serial step measured around the same time*,
``r = t_round / t_serial``, and predicts ``speedup = E / r``. Ratios, not absolute times: on a
shared machine the absolute cost of both kinds of step swings by several times within seconds
(other processes), while their ratio stays put; comparing an old round time with a fresh
serial time would decide on the load, not on the drafter.

Policy (constants below, chosen by measurement, see docs/design.md §8):
* Start speculating, alternating serial steps and rounds (serial first) until there are
  ``MIN_SAMPLES`` of each; no switch is decided on fewer. One of each is enough: a wrong
  first call is corrected by the next probe or the next round, while every extra warm-up
  round with a useless drafter costs a few percent of a short generation.
* While speculating: switch to serial when the predicted speedup falls below ``OFF``, but only
  right after a fresh serial step (otherwise take one first: under a load swing an old serial
  time makes every round look expensive). Every ``REFRESH`` rounds take one serial step anyway
  so ``t_serial`` follows the load and the context length.
* While serial: after ``probe_every`` serial steps run one speculative round (a probe). If the
  prediction then exceeds ``ON`` switch back on; otherwise double ``probe_every`` (up to
  ``PROBE_MAX``), and never probe so often that probes would cost more than
  ``PROBE_BUDGET`` of serial time (a probe loses ``round_cost - E`` serial steps, plus the
  drafter's catch-up on every token since the last round, which only a round needs), so a
  useless drafter costs a vanishing share of serial time. Switching on resets the interval
  to ``PROBE_MIN``, and so does a probe that lands between the thresholds (promising, but
  not yet convincing).
* A round emits at most ``N + 1`` tokens, so when ``(N + 1) / r < OFF`` no content can make
  speculation pay on this machine: probes then come only every ``PROBE_MAX`` steps (or
  rarer, so that they stay within ``REMEASURE_BUDGET``: measured on MLX's CPU backend, the
  taps and bookkeeping of "auto"'s serial steps already cost ~1 %), to notice a change of
  cost (load, context length).
* When the catch-up alone (a share of each serial step: the drafter's context update per
  token) already costs ``PROBE_BUDGET``, probes also come at most every ``PROBE_MAX`` steps.
* ``ON > OFF`` is the hysteresis: predictions between them keep the current mode.

Acceptance estimates are decayed counts: when position i is *tested* (all earlier drafts
accepted) ``tested_i += 1`` and ``accepted_i += [accepted]``, and all counts are multiplied by
``DECAY`` per generated token, serial or speculative. ``alpha_i = (accepted_i + m_i / 2) /
(tested_i + 1/2)``: a prior worth half a test whose mean ``m_i`` is ``alpha_{i-1}`` (1/2 for
the first position), so a position never tested counts as the one before it, one success at
the first already says 0.83, and a useless drafter's estimate sinks to ~0.01. Ageing by tokens
(not by tests) matters: after a long serial stretch the old evidence has faded, so a single
probe decides on what the content is *now*, which is what lets a change of content switch
speculation back on.

``t_serial`` is the median of the last ``COST_WINDOW`` serial steps and ``r`` the median of the
last ``COST_WINDOW`` round ratios (each round's wall time over the ``t_serial`` of that moment):
medians, because wall-time spikes are one-sided and a mean would chase them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .length import COST_WINDOW, Curve, best_length, duration, expected_tokens, median

ON = 1.05         # switch speculation on above this predicted speedup
OFF = 1.0         # switch it off below this one
DECAY = 0.95      # acceptance memory per generated token: ~20 tokens
PROBE_MIN = 16    # serial steps before the first probe
PROBE_MAX = 256   # longest gap between probes
PROBE_BUDGET = 0.02  # largest share of serial time probes may cost
REMEASURE_BUDGET = 0.01  # the same when no content could pay: probes only re-measure costs
REFRESH = 8       # speculative rounds between serial cost refreshes
PRIOR = 0.5       # acceptance prior, in tests: one success already says 0.83
EXPLORE = 16      # num_draft="auto": every 16th round drafts one more than the best length
TESTED = 0.1      # num_draft="auto": a position counts as tested lately above this decayed count
MIN_SAMPLES = 1   # measurements of each cost before any switch (each warm-up round costs)


@dataclass
class Controller:
    """Decides, before each decode step, whether it is a serial step or a speculative round.

    ``mode`` is the request's (``request.MODES``): "auto" decides, "on"/"off" always/never
    speculate (estimates are still kept, so stats can report them). ``curve``: the round cost
    at each draft length (length.py), when each round's length is chosen (``num_draft=
    "auto"``); ``num_draft`` is then the longest, else the length of every round."""

    num_draft: int
    mode: str = "auto"
    curve: Curve | None = None
    speculating: bool = True
    switches: int = 0
    probe_every: int = PROBE_MIN
    serial_times: list[float] = field(default_factory=list)
    round_ratios: list[float] = field(default_factory=list)
    catchup_ratios: list[float] = field(default_factory=list)
    catchup_totals: list[float] = field(default_factory=list)
    tested: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    rounds: int = 0
    # the predicted speedup as the latest round left it: what the current mode was decided on.
    # predicted_speedup() recomputed later drifts back to the prior as serial steps age the
    # evidence, so after a long serial stretch it would explain "serial" with a speedup > 1
    decided: float | None = None
    _since: int = 0   # serial steps since the last probe, or rounds since the last refresh

    def __post_init__(self):
        self.tested = [0.0] * self.num_draft
        self.accepted = [0.0] * self.num_draft

    # -- estimates ---------------------------------------------------------------------------

    def alpha(self) -> list[float]:
        """Each position's acceptance: its counts with a prior worth ``PRIOR`` tests, whose
        mean is the position before it (1/2 for the first): a position never tested (beyond
        the lengths "auto" chose lately) is taken to be like the last one that was."""
        out, prior = [], 0.5
        for a, t in zip(self.accepted, self.tested):
            prior = (a + PRIOR * prior) / (t + PRIOR)
            out.append(prior)
        return out

    def reach(self) -> int:
        """The longest draft length "auto" may choose: one past the deepest position tested
        lately (its decayed count above ``TESTED``). A position never tested is estimated as
        the one before it, which after a few accepted rounds says every position is accepted:
        measured on the demo pair, "auto" then jumped from 2 drafts to 5 in a request's fourth
        round, and such a round, rejected early, cost more than a 48-token request's choice
        gained; so the length grows one position at a time, as the evidence does."""
        tested = sum(1 for t in self.tested if t > TESTED)
        return min(self.num_draft, tested + 1)

    def choice(self) -> tuple[int, float]:
        """The draft length with the most expected tokens per unit of cost within
        :meth:`reach`, and that rate (tokens per serial step)."""
        n = self.reach()
        return best_length(self.alpha()[:n], self.curve.costs()[:n])

    def best(self) -> int:
        """The draft length with the most expected tokens per unit of cost."""
        if self.curve is None:
            return self.num_draft
        return self.choice()[0]

    def length(self) -> int:
        """The next round's draft length: :meth:`best`, one more every ``EXPLORE``-th round.
        Only a length that is run gets its cost measured and its last position tested, so
        without that a curve that over-prices longer rounds (measured at load, under another
        load, for another context) would never be corrected."""
        n = self.best()
        if self.curve is not None and self.rounds % EXPLORE == EXPLORE - 1:
            return min(n + 1, self.curve.longest)
        return n

    def expected_tokens(self) -> float:
        """Expected tokens emitted by a round of the best length, the bonus included."""
        return expected_tokens(self.alpha(), self.best())

    @property
    def t_serial(self) -> float | None:
        return median(self.serial_times)

    @property
    def round_cost(self) -> float | None:
        """The next round's cost in serial steps."""
        if self.curve is not None:
            return self.curve.cost(self.best())
        return median(self.round_ratios)

    @property
    def catchup_cost(self) -> float:
        """The drafter's catch-up per token, in serial steps (0 until measured)."""
        return median(self.catchup_ratios) or 0.0

    @property
    def catchup_per_probe(self) -> float:
        """A whole catch-up before a probe, in serial steps (0 until measured). A windowed
        drafter computes at most a window's worth, so after a long stretch this, not the
        per-token share, is what a probe adds."""
        return median(self.catchup_totals) or 0.0

    def predicted_speedup(self) -> float | None:
        if min(len(self.serial_times), len(self.round_ratios)) < MIN_SAMPLES:
            return None
        if self.curve is not None:      # the best length's rate, E / cost, in one pass
            return self.choice()[1]
        return self.expected_tokens() / self.round_cost

    # -- decision ----------------------------------------------------------------------------

    def speculate_next(self) -> bool:
        """True: run a speculative round next; False: a serial step."""
        if self.mode != "auto":
            return self.mode == "on"
        if len(self.serial_times) < MIN_SAMPLES:       # warm-up: serial first, then a round
            return len(self.serial_times) > len(self.round_ratios)
        if self.speculating:
            return self._since < REFRESH
        return self._since >= self.probe_every

    # -- observations ------------------------------------------------------------------------

    def observe_serial(self, seconds: float):
        seconds = duration(seconds)
        self._age(1)
        _push(self.serial_times, seconds)
        if self.speculating:
            self._since = 0                            # that was a refresh
        else:
            self._since += 1

    def observe_catchup(self, seconds: float, tokens: int):
        """Before a round the drafter caught up on ``tokens`` tokens it had not seen (the
        prompt, serial steps) in ``seconds``: work that every serial step adds once a round
        follows it, which is what makes a probe after a long serial stretch expensive."""
        seconds = duration(seconds)
        if tokens > 0 and self.t_serial:
            _push(self.catchup_ratios, seconds / tokens / self.t_serial)
            _push(self.catchup_totals, seconds / self.t_serial)

    def observe_round(self, seconds: float, num_drafted: int, num_tested: int,
                      num_accepted: int):
        """A round drafted num_drafted tokens, tested drafts 1..num_tested (all up to the
        first rejection) and accepted the first num_accepted of them.

        At a fixed length, rounds with fewer drafts than ``num_draft`` (the last round before
        max_tokens) count for acceptance but not for cost; with a ``curve`` each round prices
        its own length."""
        seconds = duration(seconds)
        self.observe_accepts(num_tested, num_accepted)
        self.rounds += 1
        if self.curve is not None:
            # a round of any length prices that length; forced on, no serial step is ever
            # timed, and the curve's own step (measured at load) stands in for one
            step = self.t_serial or self.curve.step
            if step:
                self.curve.observe(num_drafted, seconds / step)
        if self.t_serial is not None and (num_drafted == self.num_draft
                                          or self.curve is not None):
            _push(self.round_ratios, seconds / self.t_serial)
        speedup = self.decided = self.predicted_speedup()
        if self.mode != "auto":
            return
        if self.speculating:
            self._since += 1
            if speedup is not None and speedup < OFF:
                if self._since > 1:
                    self._since = REFRESH              # stale serial cost: refresh, then decide
                else:
                    self._switch(False)
                    self.probe_every = self._affordable(PROBE_MIN)
        else:
            self._since = 0
            if speedup is None:
                return
            if speedup > ON:
                self._switch(True)
                self.probe_every = PROBE_MIN
            elif speedup > OFF:
                self.probe_every = PROBE_MIN               # promising: look again soon
            else:
                self.probe_every = self._affordable(2 * self.probe_every)

    def observe_accepts(self, num_tested: int, num_accepted: int):
        """A round's verdict alone (what :meth:`observe_round` learns of the drafter): a row
        of a batch, whose round's cost is the batch's (batch_control.py), learns this much."""
        self._age(num_accepted + 1)
        for i in range(num_tested):
            self.tested[i] += 1.0
            self.accepted[i] += 1.0 if i < num_accepted else 0.0

    def observe_token(self):
        """A serial step's token alone, its cost the batch's: the evidence ages by it."""
        self._age(1)

    def ceiling(self) -> float | None:
        """The speedup of a round whose every draft is accepted: no content can beat it."""
        if self.curve is not None:
            return best_length([1.0] * self.curve.longest, self.curve.costs())[1]
        return None if self.round_cost is None else (self.num_draft + 1) / self.round_cost

    def _affordable(self, steps: int) -> int:
        """A probe interval of at least ``steps`` whose probes cost at most PROBE_BUDGET of
        serial time: a probe costs ``round_cost`` steps and emits ``E`` tokens, so it loses
        ``round_cost - E`` steps, and the drafter's catch-up costs ``catchup_cost`` per
        serial step in between. When even perfect acceptance could not reach ``OFF``, a
        probe can only re-measure the cost (which moves with the load and the context), so
        probe at most every ``PROBE_MAX`` steps, and rarer still when a probe (its round and
        its catch-up) costs so many serial steps that one per ``PROBE_MAX`` would exceed
        ``REMEASURE_BUDGET``; likewise (with ``PROBE_BUDGET``) when the catch-up alone
        exceeds the budget."""
        loss = self.round_cost - self.expected_tokens()
        whole = loss + self.catchup_per_probe
        if self.ceiling() < OFF:
            return math.ceil(max(PROBE_MAX, whole / REMEASURE_BUDGET))
        budget = PROBE_BUDGET - self.catchup_cost
        if budget <= 0:
            return math.ceil(max(PROBE_MAX, whole / PROBE_BUDGET))
        return math.ceil(min(PROBE_MAX, max(steps, loss / budget)))

    def _age(self, tokens: int):
        f = DECAY ** tokens
        self.tested = [f * t for t in self.tested]
        self.accepted = [f * a for a in self.accepted]

    def _switch(self, on: bool):
        self.speculating = on
        self.switches += 1
        self._since = 0


def _push(times: list, seconds: float):
    times.append(seconds)
    del times[:-COST_WINDOW]


