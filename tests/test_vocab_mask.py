"""A model whose vocabulary is larger than its tokenizer's (a padded embedding) never samples
an id the tokenizer cannot decode, on the drafter's side as on the target's, and speculation
stays exact: greedy and seeded-reproducible speculative output equals serial output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import api
from mlx_dspark.logits.sampling import gumbel_max, warp
from mlx_dspark.request import Request

LIMIT = 4000        # the demo's greedy answer to PROMPT uses ids above it (4060, 4038)
PROMPT = "Hello"


@pytest.fixture(scope="module")
def pair():
    pair = api.load()
    unmasked = api.generate(pair, PROMPT, max_tokens=16, speculative="off").tokens
    assert max(unmasked) >= LIMIT, "the prompt no longer reaches the padded ids"
    pair.decodable = LIMIT          # as if the tokenizer knew only the first LIMIT ids
    return pair


@pytest.mark.parametrize("options", [
    dict(), dict(temperature=0.8, seed=3, sampling="reproducible"),
    dict(temperature=1.0, seed=5, sampling="reproducible", top_p=0.9)])
def test_speculative_output_equals_serial_and_stays_below_the_tokenizer(pair, options):
    serial = api.generate(pair, PROMPT, max_tokens=40, speculative="off", **options)
    spec = api.generate(pair, PROMPT, max_tokens=40, speculative="on", **options)
    assert spec.tokens == serial.tokens
    assert max(serial.tokens) < LIMIT
    assert spec.stats.accepted > 0         # the drafter's proposals were taken


@pytest.mark.parametrize("seed", range(4))
def test_rejection_sampling_never_emits_an_id_past_the_tokenizer(pair, seed):
    out = api.generate(pair, PROMPT, max_tokens=40, speculative="on", temperature=1.5,
                       seed=seed, sampling="rejection")
    assert max(out.tokens) < LIMIT


@pytest.mark.parametrize("seed", range(2))
def test_a_request_made_without_the_pair_is_held_below_the_tokenizer_too(pair, seed):
    ids = pair.tokenizer.encode(PROMPT)
    out = api.generate(pair, Request(ids, max_tokens=40, temperature=1.5, seed=seed,
                                     speculative="on"))
    assert max(out.tokens) < LIMIT


def test_the_drafters_proposals_are_masked_too(pair):
    session = pair.session()
    api.generate(pair, PROMPT, max_tokens=4, session=session, speculative="on")
    session.flush()
    for temperature, noise in ((0.0, None),
                               (2.0, mx.random.gumbel((3, 4096), key=mx.random.key(1)))):
        drafts, _ = pair.drafter.propose(session.tokens[-1], 3, temperature=temperature,
                                         noise=noise, cache=session.draft_cache, vocab=10)
        assert max(np.array(drafts).tolist()) < 10


def test_masked_distributions_have_no_mass_past_the_limit():
    z = mx.array(np.random.default_rng(0).normal(size=(2, 50)).astype(np.float32))
    z[:, 45] = 100.0                       # the best id is past the limit
    for t in (0.0, 0.5, 1.0):
        p = np.array(warp(z, t, 0.9, 0, vocab=40))
        assert np.allclose(p.sum(-1), 1) and p[:, 40:].sum() == 0
    assert (np.array(gumbel_max(z, 0.0, 1.0, 0, None, vocab=40)) < 40).all()
