"""Edge values of temperature and top_p: the limits they tend to, never a NaN distribution
(which drew token 0, ``<pad>``, with a 200)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import api
from mlx_dspark.logits.sampling import gumbel_max, log_warp, warp


@pytest.fixture(scope="module")
def pair():
    return api.load()


def _logits(seed=0, v=64):
    z = np.random.default_rng(seed).normal(size=(3, v)).astype(np.float32)
    z[2, 5] = z[2, 9] = z[2].max() + 1.0         # a tie for the maximum in the last row
    return mx.array(z), z


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30])
def test_a_tiny_temperature_is_the_limit_mass_on_the_maxima(temperature):
    z, ref = _logits()
    p = np.array(warp(z, temperature))
    want = (ref == ref.max(axis=-1, keepdims=True)).astype(np.float64)
    want /= want.sum(axis=-1, keepdims=True)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p, want, atol=1e-6)


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    z, ref = _logits()
    logp = np.array(log_warp(z[:2], 1.0, top_p))
    assert np.isfinite(logp.max(axis=-1)).all()
    assert (np.argmax(logp, axis=-1) == ref[:2].argmax(axis=-1)).all()
    assert (np.isfinite(logp).sum(axis=-1) == 1).all()
    noise = mx.random.gumbel((2, z.shape[-1]), key=mx.random.key(3))
    assert np.array(gumbel_max(z[:2], 1.0, top_p, 0, noise)).tolist() == \
        ref[:2].argmax(axis=-1).tolist()


@pytest.mark.parametrize("options", [
    dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300),
    dict(temperature=1e-300, speculative="on"),
    dict(temperature=1e-300, speculative="on", sampling="reproducible"),
    dict(temperature=0.7, top_p=1e-300, speculative="on")])
def test_tiny_temperature_or_top_p_generates_the_greedy_text_not_pad(pair, options):
    greedy = api.generate(pair, "Hello there", max_tokens=12, speculative="off")
    got = api.generate(pair, "Hello there", max_tokens=12, seed=1, **options)
    assert "<pad>" not in got.text
    assert got.tokens == greedy.tokens


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-38, 0.5, 1e30, 1e300])
@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 0.5, 1 - 1e-16, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 64, 70])
def test_every_accepted_setting_gives_a_finite_distribution(temperature, top_p, top_k):
    z, _ = _logits()
    p = np.array(warp(z, temperature, top_p, top_k), dtype=np.float64)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, atol=1e-5)
