"""The break-even controller of a batch (docs/batching.md, docs/design.md §8): whether the
rows of a batch that leave it to "auto" speculate at this step, and how far, decided on what a
batched round costs against a batched serial step at the live batch size.

In a batch of ``B`` such rows a serial step is one forward of ``B`` tokens and emits ``B``; a
round is each row's drafter forward and one verify of ``B`` blocks, and emits what each row
accepts. What a round buys is the rows' own (each row's Controller keeps its acceptance by
position, which follows its content); what it costs is the batch's, and depends on ``B``: where
a step is bound by reading the weights (a Mac's GPU), a serial step of ``B`` rows costs little
more than one of one row while a verify of ``B`` blocks of ``N + 1`` tokens moves toward
compute-bound, so speculation pays less the larger the batch (the Lightning EAGLE-3 study's
serving rule: follow batch size, not acceptance). docs/batching.md has what this CPU measures.

So each live batch size has a :class:`SizeControl`: the single-row controller's policy (warm-up,
cost refreshes, probes, hysteresis, length choice) over that size's own measured costs (batched
serial step times; round ratios at a fixed length, or a length curve under ``num_draft="auto"``,
its prior the pair's batch-1 curve), with the rows' mean expected tokens in place of one
row's: the batch speculates at length ``n`` when ``sum_i E_i(n) / cost_B(n)``, the tokens per
batched serial step's time, beats ``B``.

At batch 1 the row's own controller decides, as alone; a request forced "on" or "off" follows
its own request. What is decided only picks the forward each row takes: every row still accepts
its own drafts, so its tokens are the same whatever is decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from .controller import MIN_SAMPLES, Controller
from .length import Curve, best_rate, expected_tokens


@dataclass
class SizeControl(Controller):
    """The controller of one live batch size: its costs are batched steps' at that size, its
    expected tokens the mean of ``rows``' (each row's acceptance, set before each decision).
    It learns no acceptance itself: a round reaches it as one that tested nothing."""

    rows: list[list[float]] = field(default_factory=list)

    def tokens(self, n: int) -> float:
        """The rows' mean expected tokens from a round of ``n`` drafts."""
        return sum(expected_tokens(alpha, n) for alpha in self.rows) / len(self.rows)

    def best(self) -> int:
        if self.curve is None:
            return self.num_draft
        return self._best()[0]

    def expected_tokens(self) -> float:
        return self.tokens(self.best())

    def predicted_speedup(self) -> float | None:
        if min(len(self.serial_times), len(self.round_ratios)) < MIN_SAMPLES:
            return None
        if self.curve is not None:
            return self._best()[1]
        return self.expected_tokens() / self.round_cost

    def _best(self) -> tuple[int, float]:
        lengths = range(1, self.curve.longest + 1)
        return best_rate([self.tokens(n) for n in lengths], self.curve.costs())


def cohort(row) -> tuple | None:
    """The rows a batch decides for together: those "auto" decides for, with a drafter, by
    their draft length (a number, or "auto") and the layers they tap (so one verify serves
    them); None for a row that follows its own request."""
    if not row.use_drafter or row.request.speculative != "auto":
        return None
    return row.request.num_draft, tuple(row.session.tap_layers or ())


class BatchControl:
    """A batch's :class:`SizeControl` for each cohort and live size, kept for as long as the
    batch runs, so a size the batch returns to decides on what it measured there."""

    def __init__(self):
        self.sizes: dict[tuple, SizeControl] = {}

    def at(self, key: tuple, rows: list) -> SizeControl:
        """The controller of ``rows`` (a cohort's, at its live size), the rows' acceptance
        set on it."""
        size = len(rows)
        control = self.sizes.get((key, size))
        if control is None:
            control = self.sizes[(key, size)] = self.make(rows[0].control, size)
        control.rows = [row.control.alpha() for row in rows]
        return control

    def make(self, like: Controller, size: int) -> SizeControl:
        """A fresh controller for ``size`` rows like ``like`` (a row's): the same fixed length,
        or under ``num_draft="auto"`` a curve of its own, whose prior is the pair's."""
        if like.curve is None:
            return SizeControl(like.num_draft)
        return SizeControl(like.curve.longest,
                           curve=Curve(list(like.curve.loaded), like.curve.step))
