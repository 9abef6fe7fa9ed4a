"""One driver (issue 42, item 1): ``decode()`` (and so ``generate``, ``stream_generate`` and
``chat``) runs a batch of one, and gives what the loop driver gave before it:
``tests/fixtures/loop_outputs.json``, made by ``tests/fixtures/make_loop_outputs.py`` at the
commit before the change (greedy, speculative, "auto", sampled with both schemes, penalties,
a thinking budget, a grammar; the DSpark, MTP and EAGLE-3 drafters)."""

from __future__ import annotations

import json
import pathlib

import pytest

import mlx_dspark as md
from mlx_dspark.decode.batch import Batch
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.stats import Stats

from fixtures.make_loop_outputs import REQUESTS

WANT = json.loads((pathlib.Path(__file__).parent / "fixtures" / "loop_outputs.json").read_text())
PAIRS = {}


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_decode_is_a_batch_of_one_and_gives_the_loop_drivers_outputs(i, monkeypatch):
    drafter, prompt, options = REQUESTS[i]
    pair = PAIRS.setdefault(drafter, md.load(drafter=drafter))
    steps, step = [], Batch.step
    monkeypatch.setattr(Batch, "step", lambda self: (steps.append(len(self.rows)),
                                                    step(self))[1])
    request = md.api.make_request(pair, prompt, **options)
    stats = Stats()
    tokens = list(decode(Session(pair.target, pair.drafter), request, stats))
    want = WANT[i]
    assert steps and set(steps) == {1}              # stepped as a batch, of one row
    assert tokens == want["tokens"]
    assert (stats.finish_reason, stats.generated) == (want["finish_reason"], want["generated"])
    if want["logprobs"] is not None:
        assert [t for t, _, _ in stats.logprobs] == [t for t, _, _ in want["logprobs"]]
        assert [lp for _, lp, _ in stats.logprobs] == pytest.approx(
            [lp for _, lp, _ in want["logprobs"]], abs=1e-6)
