"""The "reproducible" scheme: for a seed, the tokens are the same whatever the drafter does.

Serial decoding, forced speculation (a real random drafter, and oracle drafters that accept
often) and auto give identical token sequences, for several seeds, temperatures, top-p/top-k
and every num_draft, across chat turns on one session and across controller switches (driven
by a scripted controller, not by timing)."""

from functools import partial

import mlx.core as mx
import pytest

from testkit.loop_helpers import sampler_fields
from mlx_dspark.policy.controller import Controller
from mlx_dspark.request import Request
from mlx_dspark.logits.sampling import Noise, Sampler, log_warp
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter, tiny_target

V = 97
R = partial(Sampler, scheme="reproducible")
LENGTH = 20
PROMPT = [3, 14, 15, 92, 65, 35]
CASES = [  # (num_draft, seed, sampler): every num_draft, a spread of settings
    (1, 0, R(0.7)),
    (2, 1, R(1.0, top_p=0.95)),
    (3, 2, R(1.0)),
    (4, 3, R(1.3, top_k=20)),
    (5, 4, R(0.7, top_p=0.9, top_k=40)),
    (6, 5, R(1.0, top_p=0.95)),
    (7, 6, R(2.0, top_p=0.8)),
]
TIE = 1e-4   # verify and serial logits agree to ~1e-6 in fp32 (see test_speculative)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def drafter(target):
    return random_drafter(target)


def run(target, drafter, prompt, speculative, n, seed, sampler, session=None, stats=None):
    """``prompt`` decoded on ``session`` (default: a fresh one with ``drafter``), the
    sampler's settings as the request's."""
    session = session if session is not None else Session(target, drafter)
    request = Request(prompt, max_tokens=LENGTH, num_draft=n, speculative=speculative,
                      seed=seed, **sampler_fields(sampler))
    return list(decode(session, request, stats))


def assert_same_up_to_near_tie(target, prompt, out, ref, sampler, seed):
    """Identical tokens, or a first divergence where the target's top-2 of log p + g nearly
    tie (the verify pass and a serial step add in a different order)."""
    assert len(out) == len(ref)
    diff = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if diff is not None:
        seq = prompt + ref[:diff]
        logits = target(mx.array([seq]))[0, -1:]
        g = Noise(sampler, seed).at(len(seq), 1, V)
        top = mx.sort(log_warp(logits, sampler.temperature, sampler.top_p, sampler.top_k)
                      + g)[0, -2:].tolist()
        assert top[1] - top[0] < TIE, f"diverged at token {diff} (gap {top[1] - top[0]:.3g})"


class Scripted(Controller):
    """A controller whose decisions follow a fixed pattern (1: round, 0: serial step)."""

    def __init__(self, num_draft, pattern):
        super().__init__(num_draft)
        self.pattern, self.calls = pattern, 0

    def speculate_next(self):
        self.calls += 1
        return bool(self.pattern[(self.calls - 1) % len(self.pattern)])


@pytest.mark.parametrize("n,seed,sampler", CASES,
                         ids=[f"n{c[0]}-T{c[2].temperature}-p{c[2].top_p}-k{c[2].top_k}"
                              for c in CASES])
def test_serial_speculative_and_auto_give_the_same_tokens(target, drafter, n, seed, sampler):
    ref = run(target, None, PROMPT, "off", n, seed, sampler)
    assert ref != run(target, None, PROMPT, "off", n, seed + 100, sampler)   # seed matters
    stats = Stats()
    out = run(target, drafter, PROMPT, "on", n, seed, sampler, stats=stats)
    assert_same_up_to_near_tie(target, PROMPT, out, ref, sampler, seed)
    assert stats.rounds > 0
    # Oracles that know the answer accept often and reject at every position.
    accepted = drafted = 0
    for acceptance in (0.5, 0.9):
        stats = Stats()
        oracle = OracleDrafter(PROMPT + ref, V, acceptance, seed=n)
        out = run(target, oracle, PROMPT, "on", n, seed, sampler, stats=stats)
        assert_same_up_to_near_tie(target, PROMPT, out, ref, sampler, seed)
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert 0 < accepted < drafted
    # auto, with switches forced by a scripted controller: serial, round, serial, serial, ...
    session = Session(target, OracleDrafter(PROMPT + ref, V, 0.8, seed=n))
    session.controller = Scripted(n, [0, 1, 0, 0, 1, 1])
    out = run(target, session.drafter, PROMPT, "auto", n, seed, sampler, session=session)
    assert_same_up_to_near_tie(target, PROMPT, out, ref, sampler, seed)
    assert session.controller.calls > 2


def test_chat_turns_on_one_session_keep_absolute_positions(target, drafter):
    sampler, seed = R(1.0, top_p=0.95), 11
    session = Session(target, drafter)
    first = run(target, drafter, PROMPT, "on", 3, seed, sampler, session=session)
    follow = PROMPT + first + [7, 8, 9]
    second = run(target, drafter, follow, "on", 3, seed, sampler, session=session)
    # A fresh serial run of the whole conversation gives the same second answer.
    assert second == run(target, None, follow, "off", 3, seed, sampler)
    assert first == run(target, None, PROMPT, "off", 3, seed, sampler)


def test_rejection_sampling_is_reproducible_only_for_the_same_mode(target, drafter):
    sampler = Sampler(1.0, scheme="rejection")
    runs = [run(target, drafter, PROMPT, "on", 3, 7, sampler) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != run(target, drafter, PROMPT, "on", 3, 8, sampler)
