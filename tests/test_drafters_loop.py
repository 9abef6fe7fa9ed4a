"""Greedy speculation with every drafter reproduces serial greedy decoding token for token:
DSpark, DFlash, the target's MTP block, and EAGLE-3 heads (sharing the target's embedding or
with their own), each with random weights (so rejections at every position), for N = 1..7; and a
session snapshot (the server's prefix cache) restores each drafter's context."""

import pytest

from testkit.loop_helpers import serial_greedy
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.toy import random_dflash, random_drafter, random_eagle3, random_mtp, tiny_target

PROMPTS = [[3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2], [5], list(range(1, 30))]
DRAFTERS = {
    "dspark": lambda t: random_drafter(t),
    "dflash": lambda t: random_dflash(t, seed=4),
    "mtp": lambda t: random_mtp(t, seed=2),
    "eagle3": lambda t: random_eagle3(t, seed=3),
    "eagle3-own-embedding": lambda t: random_eagle3(t, seed=3, own_embedding=True),
}


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def refs(target):
    return [serial_greedy(target, p, 20) for p in PROMPTS]


@pytest.fixture(scope="module", params=list(DRAFTERS))
def drafter(request, target):
    return DRAFTERS[request.param](target)


@pytest.mark.parametrize("n", range(1, 8))
def test_speculative_greedy_with_every_drafter_equals_serial_greedy(target, refs, drafter, n):
    for prompt, ref in zip(PROMPTS, refs):
        stats = Stats()
        out = list(decode(Session(target, drafter),
                          Request(prompt, max_tokens=20, num_draft=n, speculative="on"), stats))
        assert out == ref
        assert stats.rounds > 0


def test_a_session_snapshot_restores_every_drafters_context(target, drafter):
    # what the server's prefix cache does between requests
    session = Session(target, drafter)
    list(decode(session, Request(PROMPTS[0], max_tokens=6, num_draft=3, speculative="on")))
    session.flush()
    snap = session.snapshot()
    follow = Request(session.tokens + [7], max_tokens=8, num_draft=3, speculative="on")
    first = list(decode(session, follow))
    session.restore(snap)
    assert list(decode(session, follow)) == first


def test_every_drafters_context_survives_the_prompt_caches_disk_format(target, drafter):
    import json

    import mlx.core as mx

    from mlx_dspark.prompt_cache.snapshot_file import _snapshot, _tensors
    session = Session(target, drafter)
    list(decode(session, Request(PROMPTS[0], max_tokens=6, num_draft=3, speculative="on")))
    session.flush()
    snap = session.snapshot()
    arrays, layout = _tensors(snap)
    back = _snapshot(arrays, json.loads(json.dumps(layout)), snap.origin)   # through JSON
    follow = Request(session.tokens + [7], max_tokens=8, num_draft=3, speculative="on")
    first = list(decode(session, follow))
    session.restore(back)
    assert list(decode(session, follow)) == first
    assert all(isinstance(x, mx.array) for x in arrays.values())
