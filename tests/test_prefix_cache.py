"""Session snapshots (the server's prefix reuse): a restored snapshot continues exactly as a cold
run, later steps never change a snapshot, and the cache keeps the longest prefix within its
byte budget, evicting the least recently used."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dspark import api
from mlx_dspark.prompt_cache.memory import PrefixCache
from mlx_dspark.models.nemotron_h import KVCache
from mlx_dspark.text.tokenizer import prompt_ids


@pytest.fixture(scope="module")
def pair():
    return api.load()


def test_restored_snapshot_continues_exactly_as_a_cold_run(pair):
    prompt = prompt_ids(pair.tokenizer, "import os\n" + "".join(
        f"def f{i}(x):\n    return x + {i}\n" for i in range(25)))
    session = pair.session()
    first = api.generate(pair, prompt, max_tokens=12, session=session, speculative=True)
    snap = session.snapshot()
    # past 256 positions, the KV buffers have grown once; speculative rounds built the end
    assert len(snap.tokens) == len(prompt) + 11 > KVCache.STEP
    assert first.stats["rounds"] > 0
    follow = list(snap.tokens) + [first.tokens[-1]] + prompt_ids(pair.tokenizer, "\nclass A:\n")
    cold = api.generate(pair, follow, max_tokens=24, speculative=True)
    for attempt in range(2):       # restoring does not use the snapshot up
        session.restore(snap)
        warm = api.generate(pair, follow, max_tokens=24, session=session, speculative=True)
        assert warm.stats["reused_tokens"] == len(snap.tokens)
        assert warm.tokens == cold.tokens, f"attempt {attempt}"


def test_later_steps_never_change_a_snapshot(pair):
    session = pair.session()
    api.generate(pair, prompt_ids(pair.tokenizer, "import os\n"), max_tokens=20, session=session,
                 speculative=True)
    kv = next(c for c in session.cache.layers if isinstance(c, KVCache))
    assert kv.offset < kv.keys.shape[2]     # room left: the next steps write into the buffer
    snap = session.snapshot()
    before = _arrays(snap)
    api.generate(pair, list(session.tokens) + [7, 8, 9], max_tokens=30, session=session,
                 speculative=True)
    assert session.tokens[:len(snap.tokens)] == list(snap.tokens)
    after = _arrays(snap)
    assert len(before) == len(after) > 0
    assert all(np.array_equal(b, a) for b, a in zip(before, after))
    assert snap.nbytes == sum(a.nbytes for a in before)


def _arrays(snap):
    """Copies of every array a snapshot holds."""
    return [np.array(x) for _, x in tree_flatten([snap.cache, snap.drafter, snap.pending])
            if isinstance(x, mx.array)]


@dataclass
class Entry:
    tokens: tuple
    nbytes: int


def test_find_returns_the_longest_proper_prefix():
    cache = PrefixCache(budget=100)
    for tokens in [(1,), (1, 2), (1, 2, 3), (1, 5)]:
        cache.add(Entry(tokens, 1))
    assert cache.find([1, 2, 3, 4]).tokens == (1, 2, 3)
    assert cache.find([1, 2, 3]).tokens == (1, 2)       # one token is left to prefill
    assert cache.find([1, 5, 6]).tokens == (1, 5)
    assert cache.find([2, 1]) is None


def test_least_recently_used_snapshots_go_first_within_the_budget():
    cache = PrefixCache(budget=10)
    cache.add(Entry((1,), 4))
    cache.add(Entry((2,), 4))
    cache.find([1, 9])                  # (1,) is now the most recently used
    cache.add(Entry((3,), 4))           # 12 > 10: evict (2,)
    assert (1,) in cache and (3,) in cache and (2,) not in cache
    assert cache.nbytes == 8
    cache.add(Entry((4,), 11))          # larger than the whole budget: not kept
    assert (4,) not in cache and cache.nbytes == 8
    cache.add(Entry((5,), 10))          # takes everything
    assert len(cache) == 1 and cache.nbytes == 10
