"""Speculative sampling is lossless in both schemes: the tokens it emits are distributed exactly
like sampling the (warped) target one token at a time.

The target and the drafter are Markov chains on a 5-token vocabulary (logits depend on the
previous token only), so the exact distribution of the first two emitted tokens is a product
of two warped rows, computed here in float64 NumPy independently of ``sampling.warp``. The loop's
own noise, draw and ``accept`` steps run thousands of rounds; a chi-square test compares the
counts. The same test with a deliberately broken scheme must fail (the test has teeth).

For the coupled ("reproducible") scheme the acceptance itself has a closed form, checked against
the loop's noise: with shared Gumbel noise both argmaxes pick token i with probability
``1 / sum_j max(p_j / p_i, q_j / q_i)`` (integrate the Gumbel density of g_i against the
probability that every other g_j stays below both thresholds)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.logits import sampling
from mlx_dspark.logits.sampling import Noise, Sampler
from mlx_dspark.decode.loop import accept

V, N, DRAWS = 5, 2, 2000
rng = np.random.default_rng(0)
TARGET = rng.normal(size=(V, V)) * 1.5                  # logits of token | previous token
DRAFT = TARGET + rng.normal(size=(V, V)) * 2.0           # a mediocre drafter of it
SETTINGS = [Sampler(1.0, scheme=scheme) for scheme in ("rejection", "reproducible")] + \
    [Sampler(1.3, top_p=0.9, top_k=4, scheme=scheme) for scheme in ("rejection", "reproducible")]


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
    """Counts of the first two tokens emitted by speculative rounds starting after token 0.

    Rejection: the drafter's chain draws with its own fresh noise (NumPy), as the loop's
    drafter does. Reproducible: the drafter's chain draws with the loop's positional noise of
    each draw's seed, and the target's tokens use the same rows."""
    q_rows = np.stack([warp64(DRAFT[i], s) for i in range(V)])
    draft_rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for draw in range(draws):
        noise = Noise(s, seed * draws + draw)
        out, prev = [], 0
        while len(out) < 2:
            position = len(out) + 1                    # token 0 sits at position 0
            g = noise.at(position, N + 1, V)
            drafts, ctx = [], [prev]
            for j in range(N):                         # the drafter's own chain
                if s.scheme == "rejection":
                    drafts.append(int(draft_rng.choice(V, p=q_rows[ctx[-1]])))
                else:
                    z = mx.array(DRAFT[ctx[-1]][None], dtype=mx.float32)
                    drafts.append(sampling.choose(s, z, g[j:j + 1]).item())
                ctx.append(drafts[-1])
            a, nxt = accept(mx.array(drafts, dtype=mx.int32),
                            mx.array(DRAFT[ctx[:-1]], dtype=mx.float32),
                            mx.array(TARGET[ctx], dtype=mx.float32), s, g, noise.next_key())
            a = a.item()
            out += drafts[:a] + [nxt.item()]
            prev = out[-1]
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


@pytest.mark.parametrize("s", SETTINGS,
                         ids=lambda s: f"{s.scheme}-T{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_speculative_sampling_reproduces_the_warped_target_distribution(s):
    assert check(s, draws=DRAWS if s.scheme == "rejection" else 1200) > 1e-3


def test_the_chi_square_test_fails_when_the_residual_step_is_broken(monkeypatch):
    # Resampling from p instead of normalize(max(0, p - q)) after a rejection over-weights
    # tokens the drafter likes: the distribution is no longer the target's.
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    # (measured: p ~ 1e-60 at 2000 draws; 600 draws are plenty)
    assert check(SETTINGS[0], draws=600) < 1e-6


def test_the_chi_square_test_fails_when_noise_follows_the_round_not_the_position(monkeypatch):
    # Noise indexed by the position inside the round (every round starts again at row 0)
    # reuses the first token's noise for the token after a rejection: the two are coupled.
    at = Noise.at
    monkeypatch.setattr(Noise, "at", lambda self, start, n, vocab: at(self, 1, n, vocab))
    assert check(SETTINGS[1], draws=1200) < 1e-6


def test_coupled_acceptance_keeps_drafts_while_they_match_the_target_tokens():
    target = mx.array([2, 1, 3, 0])
    for drafts, want in (([2, 1, 3], (3, 0)), ([2, 0, 3], (1, 1)), ([1, 1, 3], (0, 2))):
        a, token = sampling.accept_coupled(mx.array(drafts), target)
        assert (a.item(), token.item()) == want


def coupled_match64(p, q):
    """P(argmax(log p + g) == argmax(log q + g)) for shared Gumbel g, closed form."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return sum(1.0 / np.maximum(p / p[i], q / q[i]).sum() for i in range(len(p)) if
                   p[i] > 0 and q[i] > 0)


def coupled_match_by_integration(p, q):
    """The same probability by quadrature over g_i (float64), without the closed form."""
    g = np.linspace(-8, 40, 400001)
    f = np.exp(-g - np.exp(-g))                                  # Gumbel density
    total = 0.0
    for i in np.flatnonzero((p > 0) & (q > 0)):
        log_cdf = np.zeros_like(g)
        for j in range(len(p)):
            if j != i:                                         # g_j below both thresholds
                t = g + min(np.log(p[i] / p[j]) if p[j] > 0 else np.inf,
                            np.log(q[i] / q[j]) if q[j] > 0 else np.inf)
                log_cdf += -np.exp(-t)
        total += np.trapezoid(f * np.exp(log_cdf), g)
    return total


def test_coupled_acceptance_matches_its_closed_form():
    s = Sampler(1.0, top_p=0.95, scheme="reproducible")
    p, q = warp64(TARGET[0], s), warp64(DRAFT[0], s)
    exact = coupled_match64(p, q)
    assert abs(exact - coupled_match_by_integration(p, q)) < 1e-6
    tv = 0.5 * np.abs(p - q).sum()
    assert exact >= (1 - tv) / (1 + tv)                 # Daliri et al.'s lower bound
    m = 20000
    g = Noise(s, 3).at(0, 2 * m, V)
    target = sampling.choose(s, mx.array(np.tile(TARGET[0], (m, 1)), dtype=mx.float32), g[:m])
    draft = mx.array(np.tile(DRAFT[0], (m, 1)), dtype=mx.float32)
    sigma = math.sqrt(exact * (1 - exact) / m)
    shared = (target == sampling.choose(s, draft, g[:m])).mean().item()
    assert abs(shared - exact) < 4.5 * sigma
    # Unshared noise (the drafter draws at other positions) accepts only sum_i p_i q_i.
    unshared = (target == sampling.choose(s, draft, g[m:])).mean().item()
    assert abs(unshared - float(p @ q)) < 4.5 * sigma
    assert abs(unshared - exact) > 10 * sigma


def test_residual_is_the_normalized_positive_part_of_p_minus_q():
    p = mx.array([[0.5, 0.3, 0.2, 0.0]])
    q = mx.array([[0.2, 0.5, 0.1, 0.2]])
    assert np.allclose(np.array(sampling.residual(p, q)), [[0.75, 0.0, 0.25, 0.0]])
    assert np.allclose(np.array(sampling.residual(p, p)), np.array(p))    # p == q: never used
