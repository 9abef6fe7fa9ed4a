"""The draft length chosen each round (``num_draft="auto"``, docs/design.md §8).

A round of ``n`` drafts emits ``E(n) = 1 + sum_{j<=n} prod_{i<=j} alpha_i`` tokens on average
(the controller's per-position acceptance estimates) and costs ``cost(n)`` serial steps. The
round drafts the ``n`` that maximises ``E(n) / cost(n)``, the expected tokens per unit of time
(:func:`best_length`); the shortest such ``n`` on a tie. Nothing about which drafts are kept
changes, so the output is the same as at any fixed length: lossless by construction.

MTP and EAGLE-3 draft token by token and DSpark as a causal block (docs/design.md §6: its first
``n`` rows are exactly the block truncated), so drafting the whole block and verifying a prefix
of it would give the same drafts as drafting the prefix alone, at more cost: the choice is how
far to draft. DFlash's block is non-causal and always runs whole (``propose(n)`` returns its
first ``n`` drafts): there the choice is the prefix verified. Either way it is made before
drafting, from the estimates, and the cost curve prices each kind as it drafts.

``cost(n)`` is a :class:`Curve`: a round of each length (the drafter's ``propose(n)`` and
the target's verify of ``n + 1`` tokens, one graph as the loop's), over one serial step, measured on
a scratch session when the pair first runs "auto" (costs.py's ``measured_curve``, kept on the
drafter: a property of this target, drafter and machine, shared by its requests; taken as the
:func:`line` through those timings), then refreshed by every round the loop runs (a median per
length of its measurements within the last ``FRESH`` rounds; lengths not run lately follow the
measured ones by their offset from the load-time curve, so a longer context or a round's own
overhead moves them too).
Every ``EXPLORE``-th round (controller.py) drafts one more than the best length: only a length
that is run is measured, so a curve that over-prices longer rounds is corrected that way."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LONGEST = 7       # most drafts "auto" considers (NVIDIA's DGX Spark recipe drafts 7)
COST_WINDOW = 9   # costs = medians of this many recent measurements (spikes are one-sided)
FRESH = 32        # rounds a measurement prices its length (two EXPLORE periods, controller.py)
# seconds: one tick of the clock the decode loop reads (time.perf_counter), the least a time
# measured on it can be
TICK = time.get_clock_info("perf_counter").resolution


def duration(seconds: float) -> float:
    """A time measured as the difference of two clock readings, as a cost: never below one
    tick. A difference is zero for work shorter than a tick (a coarse clock) and negative from
    a clock that steps back; a cost of zero or less would divide by zero or make a round pay
    for itself, whatever the load."""
    return max(seconds, TICK)


def expected_tokens(alpha, n: int) -> float:
    """Tokens a round of ``n`` drafts emits on average, the bonus included."""
    e, run = 1.0, 1.0
    for a in alpha[:n]:
        run *= a
        e += run
    return e


def tokens_by_length(alpha) -> list[float]:
    """``E(n)`` for every ``n`` in ``1..len(alpha)``."""
    out, e, run = [], 1.0, 1.0
    for a in alpha:
        run *= a
        e += run
        out.append(e)
    return out


def best_length(alpha, costs) -> tuple[int, float]:
    """The draft length ``n`` in ``1..len(alpha)`` with the most expected tokens per serial
    step, ``E(n) / costs[n - 1]``, and that rate; the shortest one on a tie."""
    return best_rate(tokens_by_length(alpha), costs)


def best_rate(tokens, costs) -> tuple[int, float]:
    """The length ``n`` whose ``tokens[n - 1] / costs[n - 1]`` is the largest, and that
    rate; the shortest one on a tie (0 and 0.0 for no lengths)."""
    best = (0, 0.0)
    for n, (e, cost) in enumerate(zip(tokens, costs), 1):
        if e / cost > best[1]:
            best = (n, e / cost)
    return best


def line(costs: list[float]) -> list[float]:
    """The least-squares line through ``costs`` (a cost per length 1..len), never falling and
    never below the least cost measured: what the load-time curve is taken to be. A round is a draft and a verify, each about
    affine in the length on the backends measured (the verify flat on a Mac, linear on this
    CPU; a block drafter's draft flat), and three timings per length under a shared machine's
    load are noisy by more than a block drafter's step from one length to the next: measured
    with DFlash, raw medians priced 5 drafts below 4, and "auto" chose 5 on that. A spike at
    the long end steepens the line, which then crosses zero at the short end (seen under a
    load average of 6): no length costs less than the cheapest round timed."""
    n = len(costs)
    mean_x, mean_y = (n + 1) / 2, sum(costs) / n
    spread = sum((x - mean_x) ** 2 for x in range(1, n + 1))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(costs, 1)) / spread \
        if spread else 0.0
    slope = max(slope, 0.0)
    return [max(mean_y + slope * (x - mean_x), min(costs)) for x in range(1, n + 1)]


@dataclass
class Curve:
    """A round's cost in serial steps at each draft length 1..len(loaded): ``loaded`` as
    measured at load, ``seen`` the recent rounds' measured costs per length, each with the
    count of rounds (``rounds``) it was measured at.

    A measurement prices its length for ``FRESH`` rounds, then the length follows the ones run
    lately. A cost moves with the context and with the serial step it is priced by, so a
    length run rarely (explored, or chosen on a lucky streak) kept the price of its moment
    while the lengths run every round followed: measured with DFlash, whose block costs the
    same at every length, the curve came to price 1 draft above 2 and 6 below 3, and "auto"
    drafted 4 to 7 on cheap stale prices."""

    loaded: list[float]
    step: float | None = None     # a serial step's seconds when ``loaded`` was measured
    seen: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    rounds: int = 0

    @property
    def longest(self) -> int:
        return len(self.loaded)

    def cost(self, n: int) -> float:
        return self.costs()[n - 1]

    def measured(self, n: int) -> list[float]:
        """Length ``n``'s costs measured within the last ``FRESH`` rounds, oldest first."""
        return [r for at, r in self.seen.get(n, ()) if self.rounds - at < FRESH]

    def costs(self) -> list[float]:
        """The cost of each length 1..longest: its fresh rounds' median, else the load-time
        cost plus :meth:`offset`, never below the least cost measured (a negative offset
        would price a length at nothing or less; a length priced too low is run, and then
        measured)."""
        fresh = [self.measured(n) for n in range(1, self.longest + 1)]
        offset = self.offset(fresh)
        floor = min(self.loaded + [median(v) for v in fresh if v])
        return [median(v) if v else max(c + offset, floor) for v, c in zip(fresh, self.loaded)]

    def offset(self, fresh: list[list[float]]) -> float:
        """How far the lengths run lately sit from the load-time curve, in serial steps (0: no
        round lately). Added, not multiplied: costs are ratios to a serial step measured at
        the same time, so a load swing cancels out already, and what remains is mostly what
        a real round does beyond a draft and a verify (acceptance, rollback, bookkeeping), the
        same at every length; scaling would make the longer lengths look dearer than they
        are."""
        gaps = [median(v) - c for v, c in zip(fresh, self.loaded) if v]
        return median(gaps) if gaps else 0.0

    def observe(self, n: int, ratio: float):
        self.rounds += 1
        seen = self.seen.setdefault(n, [])
        seen.append((self.rounds, ratio))
        del seen[:-COST_WINDOW]


def longest(drafter) -> int:
    return min(LONGEST, drafter.max_draft)


def median(values: list) -> float | None:
    """The median (the upper one of an even count; None for none)."""
    return sorted(values)[len(values) // 2] if values else None
