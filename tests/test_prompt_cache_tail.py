"""Checkpoints where agents edit (prompt_cache/cache.py ``TAIL``, issue 42): an edit of the last
500 tokens of a prompt's last message re-prefills at most 600 tokens, a turn appended only the
new turn, the tail's stops change no bit of what a prefill computes, and under byte pressure
the cache evicts tail checkpoints before message ends before each agent's system prompt.
Demo pair, greedy."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dspark import api
from mlx_dspark.decode.loop import prefill
from mlx_dspark.prompt_cache.cache import TAIL, PromptCache
from mlx_dspark.text.tokenizer import message_boundaries, prompt_ids


@pytest.fixture(scope="module")
def pair():
    return api.load()


def cached(pair, memory_bytes=1 << 30):
    return dataclasses.replace(pair, prompt_cache=PromptCache(memory_bytes))


def source(n_chars: int) -> str:
    """Python source, the demo model's kind of text (json's decoder and encoder, repeated)."""
    import inspect
    import json.decoder
    import json.encoder
    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    return (text * (n_chars // len(text) + 1))[:n_chars]


def agent(system: str, chars: int) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": source(chars)}]


SYSTEM_A = "You are a coding agent working on a JSON library. " + " ".join(
    f"Rule {i}: keep the function named step_{i} pure." for i in range(30))
SYSTEM_B = "You review pull requests for a web service and answer in short lists. " + " ".join(
    f"Check {i}: the handler route_{i} validates its input." for i in range(30))


def rewritten(messages: list[dict], tokens_from_end: int, tokenizer, chars: int = 40):
    """``messages`` with ``chars`` characters of the last message rewritten where its last
    ``tokens_from_end`` tokens begin (an agent rewriting the tail of its last message)."""
    text = messages[-1]["content"]
    at = len(text) - chars
    while len(tokenizer.encode(text[at:])) < tokens_from_end:
        at -= 1
    new = "".join(c if c == "\n" else "#" for c in text[at:at + chars])
    return messages[:-1] + [{**messages[-1], "content": text[:at] + new + text[at + chars:]}]


def reprefilled(result) -> int:
    return result.stats.prompt_tokens - result.stats.reused_tokens


@pytest.mark.parametrize("chars", [pytest.param(24_500, marks=pytest.mark.slow), 3_000])
def test_an_edit_of_the_last_500_tokens_reprefills_at_most_600(pair, chars):
    """An ~8k-token prompt (slow lane) and a ~1k one: after the first request, its last 40
    characters rewritten and 40 characters 500 tokens before its end rewritten. Before the
    tail checkpoints the 8k prompt re-prefilled 4,002 and 3,999 tokens (from the checkpoint at
    4096), the 1k one all but its system prompt."""
    warm = cached(pair)
    first = api.generate(warm, agent(SYSTEM_A, chars), chat=True, max_tokens=2)
    if chars > 10_000:
        assert 7_500 < first.stats.prompt_tokens < 8_500
    for tokens_from_end, most in [(0, 100), (500, 600)]:
        edit = rewritten(agent(SYSTEM_A, chars), tokens_from_end, pair.tokenizer)
        got = api.generate(warm, edit, chat=True, max_tokens=4)
        assert reprefilled(got) <= most, (tokens_from_end, got.stats.prompt_tokens)
        assert got.tokens == api.generate(pair, edit, chat=True, max_tokens=4).tokens


def test_appending_a_turn_reprefills_only_the_new_turn(pair):
    """Held before the tail checkpoints too (the end of the answer, and before the last
    prompt token, are remembered); checked here so the tail's stops do not cost it."""
    warm = cached(pair)
    messages = agent(SYSTEM_A, 3_000)
    first = api.generate(warm, messages, chat=True, max_tokens=8)
    turn = messages + [{"role": "assistant", "content": first.text},
                       {"role": "user", "content": "Now write a test for it."}]
    got = api.generate(warm, turn, chat=True, max_tokens=4)
    assert reprefilled(got) <= got.stats.prompt_tokens - first.stats.prompt_tokens + 1
    assert got.tokens == api.generate(pair, turn, chat=True, max_tokens=4).tokens


def test_a_turn_appended_after_the_tail_is_rewritten_reprefills_the_tail_and_the_turn(pair):
    """What Claude Code sends: its last message's tail rewritten (a reminder moved), then the
    answer and a new message. Before the tail checkpoints, everything after the system prompt
    was prefilled again (about 1,000 tokens here)."""
    warm = cached(pair)
    messages = agent(SYSTEM_A, 3_000)
    first = api.generate(warm, messages, chat=True, max_tokens=8)
    turn = rewritten(messages, 20, pair.tokenizer) + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now write a test for it."}]
    got = api.generate(warm, turn, chat=True, max_tokens=4)
    new = got.stats.prompt_tokens - first.stats.prompt_tokens
    assert reprefilled(got) <= new + TAIL[-1] + 64 + 20, (reprefilled(got), new)
    assert got.tokens == api.generate(pair, turn, chat=True, max_tokens=4).tokens


def _state(pair, cache, messages):
    """Where ``cache`` has the prefill of ``messages`` stop, how many tokens it reused, and the
    session's state after it (a cache without a memory tier, ``PromptCache(0)``, plans its
    stops but none near the end: only the memory tier keeps those)."""
    session = pair.session()
    ids = prompt_ids(pair.tokenizer, messages, True)
    reused = cache.start(session, ids, message_boundaries(pair.tokenizer, messages, {}, ids))
    stops = set(session.checkpoints)
    prefill(session, ids, tap=True)
    cache.finish(session)
    return stops, reused, _arrays(session.snapshot(), pair.drafter.context_keep)


def _arrays(snap, keep: int) -> list:
    """What a snapshot's state is: every array of both caches, and the last ``keep`` queued
    taps, the ones a proposal reads (how many older ones are still queued depends on where
    the prefill stopped: Session.feed drops them in windows, to the same drafter state)."""
    states = [np.array(x) for _, x in tree_flatten([snap.cache, snap.drafter])
              if isinstance(x, mx.array)]
    return states + [np.concatenate([np.array(p) for p in snap.pending])[-keep:]]


def test_the_tail_stops_change_no_bit_of_what_a_prefill_computes(pair):
    """The tail's stops are a whole number of Mamba chunks past the stop before them: the
    same prompt gives the same bits with and without them, and an edited prompt continued
    from one gives the bits of its own cold run."""
    messages = agent(SYSTEM_A, 3_000)
    stops, _, with_tail = _state(pair, PromptCache(1 << 28), messages)
    others, _, without = _state(pair, PromptCache(0), messages)
    tail = stops - others
    assert len(tail) == len(TAIL) and others < stops
    assert len(with_tail) == len(without) > 0
    assert all(np.array_equal(a, b) for a, b in zip(with_tail, without))

    edit = rewritten(messages, 100, pair.tokenizer)
    warm = PromptCache(1 << 28)
    _state(pair, warm, messages)
    _, reused, continued = _state(pair, warm, edit)
    _, _, cold = _state(pair, PromptCache(1 << 28), edit)
    assert reused in tail
    assert len(continued) == len(cold) > 0
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(continued, cold))


def test_a_long_two_agent_session_keeps_each_agents_system_prompt(pair):
    """Two agents with their own system prompts take turns for 8 rounds, each appending a
    turn and rewriting the tail of its previous message, the cache held to a few snapshots'
    bytes: every snapshot taken evicts others, the tail checkpoints first, and each agent's
    system-prompt checkpoint stays. With least-recently-used alone, agent a's was gone in the
    second round."""
    session = {}
    for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": source(600)}]
        ids = prompt_ids(pair.tokenizer, messages, True)
        session[name] = {"messages": messages,
                         "system": tuple(ids[:message_boundaries(pair.tokenizer, messages,
                                                                 {}, ids)[0]])}
    warm = cached(pair, memory_bytes=6 << 20)
    memory, evicted = warm.prompt_cache.memory, set()
    for round_ in range(8):
        for name in ("a", "b"):
            agent_ = session[name]
            held = set(memory._entries)
            got = api.generate(warm, agent_["messages"], chat=True, max_tokens=6)
            evicted |= held - set(memory._entries)
            agent_["served"] = True
            agent_["messages"] = rewritten(agent_["messages"], 10, pair.tokenizer, 12) + [
                {"role": "assistant", "content": got.text},
                {"role": "user", "content": f"round {round_}: " + source(300)}]
            for other in (a for a in session.values() if a.get("served")):
                assert ("", other["system"]) in memory._entries, (round_, name)
    assert memory.nbytes <= memory.budget
    assert len(evicted) > 20                            # the budget was under pressure
    for name, agent_ in session.items():               # a new conversation of each agent
        fresh = [agent_["messages"][0], {"role": "user", "content": "def main():"}]
        got = api.generate(warm, fresh, chat=True, max_tokens=2)
        assert got.stats.reused_tokens == len(agent_["system"]), name


def test_health_shows_the_tail_and_the_snapshots_of_each_rank(pair):
    warm = cached(pair)
    api.generate(warm, agent(SYSTEM_A, 3_000), chat=True, max_tokens=2)
    health = json.loads(json.dumps(warm.prompt_cache.health()))
    assert health["tail"] == list(TAIL)
    assert health["memory"]["ranks"]["system"] == 1
    assert health["memory"]["ranks"]["edit"] == len(TAIL)
