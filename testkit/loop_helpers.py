"""Serial references for the loop, controller and API tests (the tiny random models they run
on: testkit.toy)."""

from __future__ import annotations

import mlx.core as mx

from mlx_dspark.policy.batch_control import BatchControl, SizeControl
from mlx_dspark.policy.controller import Controller
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode


def serial_greedy(target, prompt, max_tokens) -> list[int]:
    return list(decode(Session(target), Request(prompt, max_tokens=max_tokens,
                                                speculative="off")))


def sampler_fields(sampler) -> dict:
    """A :class:`~mlx_dspark.logits.sampling.Sampler`'s settings as :class:`Request` fields."""
    return dict(temperature=sampler.temperature, top_p=sampler.top_p, top_k=sampler.top_k,
                sampling=sampler.scheme)


def top2_gap(target, tokens) -> float:
    """Gap between the target's two largest logits after ``tokens`` (full forward)."""
    logits = target(mx.array([tokens]))[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


class FixedCosts(Controller):
    """The real controller with the loop's wall times replaced by fixed costs (a serial step
    costs 1, a round ``round_cost``): its decisions then depend only on what the drafter
    accepts, never on the machine's load. Install it as ``session.controller`` (or
    ``pair.controller``) before decoding with the same num_draft and "auto"."""

    def __init__(self, num_draft: int, round_cost: float):
        super().__init__(num_draft)
        self.cost = round_cost

    def observe_serial(self, seconds: float):
        super().observe_serial(1.0)

    def observe_catchup(self, seconds, tokens):
        super().observe_catchup(0.0, tokens)

    def observe_round(self, seconds, num_drafted, num_tested, num_accepted):
        super().observe_round(self.cost, num_drafted, num_tested, num_accepted)


class FixedSizeCosts(FixedCosts, SizeControl):
    """A batch's controller of one live size (decode/batch_control.py) on fixed costs: a
    batched serial step costs 1, a batched round ``round_cost``."""


class FixedBatchCosts(BatchControl):
    """A batch's controllers on fixed costs: ``round_cost[B]`` batched serial steps a round at
    live size B costs. Install it as ``batch.control`` before the first step."""

    def __init__(self, round_cost: dict[int, float]):
        super().__init__()
        self.cost = round_cost

    def make(self, like, size):
        return FixedSizeCosts(like.num_draft, self.cost[size])
