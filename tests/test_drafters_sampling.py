"""Sampling with every drafter (DSpark, DFlash, the MTP block, an EAGLE-3 head with a reduced draft
vocabulary) reproduces the target's distribution: the first three tokens the whole loop emits
(prefill, then speculative rounds with rollback) are counted over many seeds and compared by
chi-square with the exact probabilities, computed from full target forwards in float64.

tests/test_sampling_acceptance.py proves the acceptance step on Markov chains (with teeth: a
broken scheme fails it); this one runs the real loop and the real drafters on a tiny target
with a 6-token vocabulary."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from testkit.toy import random_dflash, random_drafter, random_eagle3, random_mtp, tiny_target
from test_sampling_acceptance import chi2_pvalue

V, PROMPT, DRAWS = 6, [1, 4, 2, 5, 3], 800


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=4, vocab_size=V)


def exact_triples(target) -> np.ndarray:
    def probs(prefix):
        z = np.array(target(mx.array([PROMPT + list(prefix)]))[0, -1], np.float64)
        p = np.exp(z - z.max())
        return p / p.sum()
    return triples(probs)


def triples(probs) -> np.ndarray:
    """The probability of every first three tokens ``[V, V, V]``, from ``probs(prefix)``, the
    distribution of the token after the prompt and ``prefix``."""
    out = np.zeros((V, V, V))
    p1 = probs(())
    for a in range(V):
        p2 = probs((a,))
        for b in range(V):
            out[a, b] = p1[a] * p2[b] * probs((a, b))
    return out


DRAFTERS = {
    "dspark": lambda t: random_drafter(t, tap_layers=(1, 3)),
    "dflash": lambda t: random_dflash(t, tap_layers=(1, 3)),
    "mtp": lambda t: random_mtp(t),
    "eagle3": lambda t: random_eagle3(t, draft_vocab=4, aux=(1, 3, 5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_rejection_sampling_with_every_drafter_matches_the_target(target, name):
    # Rejection sampling is where the drafter's logits enter the output distribution (the
    # reproducible scheme's tokens are the target's whatever the drafter says).
    scheme = "rejection"
    drafter = DRAFTERS[name](target)
    session = Session(target, drafter)
    list(decode(session, Request(PROMPT[:-1], max_tokens=1, speculative="off")))
    snap = session.snapshot()                  # the prompt but its last token, prefilled once
    counts = np.zeros((V, V, V))
    for seed in range(DRAWS):
        session.restore(snap)
        # token 1 from the prompt's logits, then a round of 2 drafts (and more if needed)
        out = list(decode(session, Request(PROMPT, max_tokens=4, temperature=1.0, seed=seed,
                                           num_draft=2, speculative="on", sampling=scheme)))
        counts[tuple(out[:3])] += 1
    expected = exact_triples(target) * DRAWS
    small = expected < 5                       # merged into one cell for the chi-square
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    assert chi2_pvalue(c, e) > 1e-3
