"""Speculative sampling is lossless: the tokens it emits are distributed exactly like sampling
the (warped) target one token at a time.

The target and the drafter are Markov chains on a 5-token vocabulary (logits depend on the
previous token only), so the exact distribution of the first two emitted tokens is a product
of two warped rows, computed here in float64 NumPy independently of ``sampling.warp``. The loop's
own ``accept`` step runs thousands of rounds; a chi-square test compares the counts. The same
test with a deliberately broken residual step must fail (the test has teeth)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import sampling
from mlx_dspark.speculative import Sampler, accept

V, N, DRAWS = 5, 2, 2000
rng = np.random.default_rng(0)
TARGET = rng.normal(size=(V, V)) * 1.5                  # logits of token | previous token
DRAFT = TARGET + rng.normal(size=(V, V)) * 2.0           # a mediocre drafter of it
SETTINGS = [Sampler(1.0), Sampler(1.3, top_p=0.9, top_k=4)]   # plain, and both filters


def warp64(logits, s: Sampler):
    """Reference warping in float64: temperature, then top-k, then top-p (nucleus: keep the
    most likely tokens while the mass before them is < top_p)."""
    z = logits / s.temperature
    if s.top_k:
        z = np.where(z < np.sort(z)[-s.top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros(V, bool)
        keep[order[before < s.top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def chi2_pvalue(counts, expected):
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation of the tail)."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = len(counts) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def first_two_tokens(s: Sampler, draws: int, seed: int = 0):
    """Counts of the first two tokens emitted by speculative rounds starting after token 0."""
    q_rows = np.stack([warp64(DRAFT[i], s) for i in range(V)])
    draft_rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    counts = np.zeros((V, V))
    for _ in range(draws):
        out, prev = [], 0
        while len(out) < 2:
            drafts, ctx = [], [prev]
            for _ in range(N):                  # the drafter's own chain: d_j ~ q(. | d_{j-1})
                drafts.append(int(draft_rng.choice(V, p=q_rows[ctx[-1]])))
                ctx.append(drafts[-1])
            key, sub = mx.random.split(key)
            a, nxt = accept(drafts, mx.array(DRAFT[ctx[:-1]], dtype=mx.float32),
                            mx.array(TARGET[ctx], dtype=mx.float32), s, sub)
            out += drafts[:a] + [nxt]
            prev = nxt
        counts[out[0], out[1]] += 1
    return counts


def expected_first_two(s: Sampler, draws: int):
    p = np.stack([warp64(TARGET[i], s) for i in range(V)])
    return draws * p[0][:, None] * p


def check(s: Sampler, draws=DRAWS):
    counts = first_two_tokens(s, draws)
    expected = expected_first_two(s, draws)
    support = expected > 0
    assert counts[~support].sum() == 0, "emitted a token the warped target excludes"
    return chi2_pvalue(counts[support], expected[support])


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_speculative_sampling_reproduces_the_warped_target_distribution(s):
    assert check(s) > 1e-3


def test_the_chi_square_test_fails_when_the_residual_step_is_broken(monkeypatch):
    # Resampling from p instead of normalize(max(0, p - q)) after a rejection over-weights
    # tokens the drafter likes: the distribution is no longer the target's.
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    # (measured: p ~ 1e-60 at 2000 draws; 600 draws are plenty)
    assert check(SETTINGS[0], draws=600) < 1e-6


def test_greedy_acceptance_keeps_drafts_while_they_match_the_target_argmax():
    logits = mx.array(np.eye(4)[[2, 1, 3, 0]] * 5.0, dtype=mx.float32)   # argmax 2, 1, 3, 0
    assert sampling.accept_greedy([2, 1, 3], logits) == (3, 0)            # all + bonus
    assert sampling.accept_greedy([2, 0, 3], logits) == (1, 1)            # correction at 2
    assert sampling.accept_greedy([1, 1, 3], logits) == (0, 2)


def test_residual_is_the_normalized_positive_part_of_p_minus_q():
    p = mx.array([[0.5, 0.3, 0.2, 0.0]])
    q = mx.array([[0.2, 0.5, 0.1, 0.2]])
    assert np.allclose(np.array(sampling.residual(p, q)), [[0.75, 0.0, 0.25, 0.0]])
    assert np.allclose(np.array(sampling.residual(p, p)), np.array(p))    # p == q: never used
