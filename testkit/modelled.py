"""``num_draft="auto"`` against every fixed length on a machine's measured cost curve, with the
clock taken out: each round costs what the curve says a round of its length costs, so the
comparison is exact and repeatable, and what remains is the choice itself (the acceptance
estimates, the exploration, the prior at a request's start). The curves are measured once per
machine and BLAS build (benchmarks/auto_curves.py writes tests/fixtures/auto_curves.json);
tests/test_auto_bound.py and benchmarks/bench_auto_modelled.py use them. The wall-clock side of
the same comparison is benchmarks/bench_auto_length.py, whose run-to-run spread on a shared
machine (5 to 15 %) is larger than the bound it would test."""

from __future__ import annotations

from mlx_dspark.api import generate
from mlx_dspark.policy.controller import Controller
from mlx_dspark.policy.length import Curve, line


class Modelled(Controller):
    """A forced-speculation controller that keeps each round's draft length (``lengths``) and
    feeds its curve the modelled cost, not the wall time. ``costs``: a round's cost in serial
    steps at each length 1..len; given, the round lengths are chosen ("auto") on the
    least-squares line through them, as the real load-time curve is taken
    (:func:`~mlx_dspark.policy.length.line`), then refreshed by what the rounds cost; None:
    ``num_draft`` drafts every round."""

    def __init__(self, num_draft: int | None = None, costs: list[float] | None = None):
        curve = Curve(line(costs), 1.0) if costs else None
        super().__init__(len(costs) if costs else num_draft, mode="on", curve=curve)
        self.costs, self.lengths = costs, []

    def observe_round(self, seconds, num_drafted, num_tested, num_accepted):
        self.lengths.append(num_drafted)
        cost = self.costs[num_drafted - 1] if self.costs else seconds
        super().observe_round(cost, num_drafted, num_tested, num_accepted)


def spent(lengths: list[int], costs: list[float]) -> float:
    """Serial steps that rounds of these lengths cost on ``costs``."""
    return sum(costs[n - 1] for n in lengths)


def run(pair, prompt, num_draft=None, costs=None, max_tokens: int = 48) -> tuple[int, list[int]]:
    """Greedy decoding of ``prompt`` (token ids) under :class:`Modelled` (``num_draft`` drafts
    a round, or "auto" on ``costs``): the tokens the rounds emitted (the first comes from the
    prefill) and each round's draft length."""
    control = pair.controller = Modelled(num_draft, costs)
    try:
        out = generate(pair, prompt, max_tokens=max_tokens, num_draft="auto" if costs else
                       num_draft, speculative="auto")    # "auto" keeps the installed controller
    finally:
        pair.controller = None
    return len(out.tokens) - 1, control.lengths


def rates(pair, prompts, curves: dict, lengths=range(1, 8), max_tokens: int = 48) -> dict:
    """Tokens per serial step over ``prompts`` at each fixed length and at "auto", on each
    named curve: ``{curve: {n or "auto": rate}}``. A fixed length's rounds do not depend on
    the costs, so each is decoded once and priced on every curve."""
    fixed = {n: [run(pair, p, n, max_tokens=max_tokens) for p in prompts] for n in lengths}
    out = {}
    for name, costs in curves.items():
        runs = dict(fixed, auto=[run(pair, p, costs=costs, max_tokens=max_tokens)
                                 for p in prompts])
        out[name] = {n: sum(t for t, _ in r) / sum(spent(ls, costs) for _, ls in r)
                     for n, r in runs.items()}
    return out


def against_best(rate: dict) -> tuple[int, float]:
    """The best fixed length in one curve's :func:`rates`, and auto's rate over its rate."""
    fixed = {n: r for n, r in rate.items() if n != "auto"}
    best = max(fixed, key=fixed.get)
    return best, rate["auto"] / fixed[best]
