"""The prompt cache (prompt_cache/cache.py, prompt_cache/disk.py): checkpoints at message ends and every K
tokens while prefilling, continued from by any request that shares the prefix, token for token
what a cold run gives; snapshots on disk across restarts, verified, within their budget, and
anything foreign, corrupt, truncated, symlinked or unwritable skipped with one warning; the
memory budget counts what the cache really holds."""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import signal

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import api
from mlx_dspark.prompt_cache.cache import PromptCache
from mlx_dspark.prompt_cache.disk import LOCK, PromptStore, identity, open_store
from mlx_dspark.decode.loop import prefill
from testkit import spoil as spoil_ways
from mlx_dspark.text.tokenizer import message_boundaries, prompt_ids

SYSTEM = {"role": "system", "content": "You write Python for a data team. " + " ".join(
    f"def helper_{i}(rows): return [r for r in rows if r > {i}]" for i in range(20))}


def conversation(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def pair():
    return api.load()


_COLD = {}


def cold(pair, prompt, **options):
    """What the pair without a prompt cache gives (computed once per prompt and options)."""
    key = repr((prompt, sorted(options.items())))
    if key not in _COLD:
        _COLD[key] = api.generate(pair, prompt, **options).tokens
    return _COLD[key]


def cached(pair, tmp_path=None, every=4096, memory_mb=256, disk_bytes=10**9, warn=None):
    """The pair with a prompt cache of its own (in memory; on disk under ``tmp_path``)."""
    store = open_store(tmp_path, pair, True, disk_bytes, warn) if tmp_path else None
    return dataclasses.replace(pair, prompt_cache=PromptCache(memory_mb << 20, store, every))


def system_end(pair) -> int:
    messages = conversation("x")
    ids = prompt_ids(pair.tokenizer, messages, True)
    return message_boundaries(pair.tokenizer, messages, {}, ids)[0]


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None),
                                               pytest.param(0.8, 7, marks=pytest.mark.slow)])
def test_a_new_conversation_continues_from_the_system_prompt_as_a_cold_run(
        pair, mode, temperature, seed):
    options = dict(max_tokens=12, chat=True, speculative=mode, temperature=temperature,
                   seed=seed, sampling="reproducible")
    warm = cached(pair)
    api.generate(warm, conversation("def parse(line):"), **options)
    got = api.generate(warm, conversation("class Table:"), **options)
    assert got.stats.reused_tokens == system_end(pair)      # the system prompt's checkpoint
    assert got.tokens == cold(pair, conversation("class Table:"), **options)


def test_after_a_checkpoint_the_state_is_bit_identical_to_the_cold_runs(pair):
    """Cuts depend on the prompt alone: continuing from a checkpoint computes exactly what the
    cold run computed after it (Mamba states, keys, values, queued taps, to the bit)."""
    def prompt_state(cache, messages):
        session = pair.session()
        ids = prompt_ids(pair.tokenizer, messages, True)
        reused = cache.start(session, ids, message_boundaries(pair.tokenizer, messages, {}, ids))
        prefill(session, ids, tap=True)
        cache.finish(session)
        return reused, _arrays(session.snapshot())

    _, cold = prompt_state(PromptCache(1 << 28), conversation("class Table:"))
    warm = PromptCache(1 << 28)
    prompt_state(warm, conversation("def parse(line):"))
    reused, got = prompt_state(warm, conversation("class Table:"))
    assert reused == system_end(pair)
    assert len(got) == len(cold) > 0
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, cold))


def test_long_prompts_get_a_checkpoint_every_k_tokens(pair):
    prompt = list(range(5, 205))
    warm = cached(pair, every=64)
    api.generate(warm, prompt, max_tokens=2)
    got = api.generate(warm, prompt[:150] + [9, 9, 9], max_tokens=4)
    assert got.stats.reused_tokens == 128
    assert got.tokens == cold(pair, prompt[:150] + [9, 9, 9], max_tokens=4)


def test_snapshots_on_disk_survive_a_restart(pair, tmp_path):
    first = cached(pair, tmp_path)
    api.generate(first, conversation("def parse(line):"), max_tokens=8, chat=True)
    assert first.prompt_cache.store.writes >= 2        # the system prompt, the prompt, ...
    restarted = cached(pair, tmp_path)                  # a new process: memory is empty
    got = api.generate(restarted, conversation("class Table:"), max_tokens=12, chat=True)
    assert restarted.prompt_cache.found == {"memory": 0, "disk": 1, "none": 0}
    assert got.stats.reused_tokens == system_end(pair)
    assert got.tokens == cold(pair, conversation("class Table:"), max_tokens=12, chat=True)


@pytest.mark.parametrize("spoil", list(spoil_ways.WAYS))
@pytest.mark.parametrize("when", ["before-start",
                                  pytest.param("after-start", marks=pytest.mark.slow)])
def test_an_unusable_snapshot_file_is_skipped_with_one_warning(pair, tmp_path, spoil, when):
    question = conversation("class Table:")
    ids = prompt_ids(pair.tokenizer, question, True)
    first = cached(pair, tmp_path)
    api.generate(first, [SYSTEM, {"role": "user", "content": "x"}], max_tokens=2, chat=True)
    path = first.prompt_cache.store.find(ids).path       # the system prompt's snapshot
    if spoil == "other-user" and os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    spoil = spoil_ways.WAYS[spoil]
    warnings = []
    if when == "after-start":                # spoiled while a server that indexed it runs
        restarted = cached(pair, tmp_path, warn=warnings.append)
        spoil(path)
    else:
        spoil(path)
        restarted = cached(pair, tmp_path, warn=warnings.append)
    got = api.generate(restarted, question, max_tokens=12, chat=True)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert got.stats.reused_tokens == 0                 # prefilled cold
    assert got.tokens == cold(pair, question, max_tokens=12, chat=True)


def test_a_full_disk_keeps_the_snapshot_in_memory_with_one_warning(pair, tmp_path):
    warnings = []
    warm = cached(pair, tmp_path, warn=warnings.append)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        api.generate(warm, conversation("def parse(line):"), max_tokens=4, chat=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_signal)
    assert len(warnings) == 1 and "cannot write" in warnings[0], warnings
    assert not [n for n in os.listdir(tmp_path) if n not in ("named", LOCK)]   # no temporary
    got = api.generate(warm, conversation("class Table:"), max_tokens=4, chat=True)
    assert got.stats.reused_tokens == system_end(pair)   # from memory


def test_the_disk_budget_holds_under_many_prompts(pair, tmp_path):
    budget = 3_000_000
    warm = cached(pair, tmp_path, every=64, disk_bytes=budget)
    for i in range(6):
        api.generate(warm, [i + 3] * (70 + 20 * i), max_tokens=2)
        files = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path)
                 if n not in ("named", LOCK)]
        assert sum(os.path.getsize(f) for f in files) == warm.prompt_cache.store.nbytes
        assert warm.prompt_cache.store.nbytes <= budget
    assert warm.prompt_cache.store.writes > len(warm.prompt_cache.store.entries)   # evicted


def test_the_memory_budget_counts_what_the_cache_holds(pair):
    """Shared arrays count once, and no snapshot keeps a larger buffer alive through a view
    (the Mamba conv window of a long step used to hold the step's whole input)."""
    session = pair.session()
    api.generate(pair, [5] * 20, max_tokens=2, session=session)     # warm up the allocator
    del session
    gc.collect()
    before = mx.get_active_memory()
    cache = PromptCache(1 << 30, every=64)
    warm = dataclasses.replace(pair, prompt_cache=cache)
    for i in range(4):
        api.generate(warm, [i + 3] * 300 + [7] * (10 * i), max_tokens=3)
    gc.collect()
    held = mx.get_active_memory() - before
    assert len(cache.memory) >= 12
    assert held <= cache.memory.nbytes * 1.03 + (1 << 20), (held, cache.memory.nbytes)


def test_snapshots_are_found_only_in_their_own_space(pair):
    warm = cached(pair)
    ids = prompt_ids(pair.tokenizer, conversation("def parse(line):"), True)
    cache = warm.prompt_cache
    session = pair.session()
    cache.start(session, ids, (), space="alice")
    prefill(session, ids, tap=True)
    cache.finish(session)
    cache.remember(session, "alice")
    longer = ids + [5, 6]
    assert cache.start(pair.session(), longer, (), space="alice") == len(ids)
    assert cache.start(pair.session(), longer, (), space="bob") == 0
    assert cache.start(pair.session(), longer, ()) == 0


def test_a_store_refuses_a_directory_that_is_a_symlink(pair, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ident = identity("m", "d", mx.float32, "M*")
    with pytest.raises(OSError, match="not a directory"):
        PromptStore(tmp_path / "link", ident, 10**6)


def _arrays(snap):
    return [np.array(x) for x in snap.arrays()]


def test_load_with_a_prompt_cache_dir_reuses_across_pairs(tmp_path):
    import mlx_dspark as md
    first = md.load(prompt_cache_dir=tmp_path)
    md.generate(first, conversation("def parse(line):"), max_tokens=2, chat=True)
    again = md.load(prompt_cache_dir=tmp_path)          # as after a restart
    got = md.generate(again, conversation("class Table:"), max_tokens=2, chat=True)
    assert got.stats.reused_tokens == system_end(again)


def test_message_ends_are_found_where_the_template_puts_them(pair):
    """The ends of the first two and the last three messages: each is the length of the ids
    of the conversation up to there (the template's own rendering of that prefix)."""
    turns = [SYSTEM] + [{"role": r, "content": f"{r} message {i}"}
                        for i, r in enumerate(["user", "assistant"] * 4)]
    ids = prompt_ids(pair.tokenizer, turns, True)
    found = message_boundaries(pair.tokenizer, turns, {}, ids)
    want = []
    for i in (1, 2, 6, 7, 8):
        text = pair.tokenizer.apply_chat_template(turns[:i], tokenize=False,
                                                  add_generation_prompt=False)
        head = list(pair.tokenizer.encode(text, add_special_tokens=False))
        if ids[:len(head)] == head:
            want.append(len(head))
    assert found == want and len(found) >= 3
