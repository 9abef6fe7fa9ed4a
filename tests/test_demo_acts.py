"""The shipped demo pair acts as issue 41 asks, on held-out prompts and held-out tool sets
(testkit/demo_acts.py; `benchmarks/bench_demo_acts.py` prints the same numbers):
through the server's tool path it calls the right tool with the argument the user named, a
forced call closes, the answer after a tool's result stops; with thinking on it writes a
thought and closes it; its greedy text does not loop, and speculation with DSpark gives at least 2.3 tokens per
round on the same prompts; and on Codex's and opencode's own recorded requests (testkit/agent_turns.py,
item 4 without npm) it calls the agent's tool with the command or file the user named, then
answers after the result and stops. The shipped demo (step 3d's ab_1) meets all but the first,
the third and the agent turns (its numbers: training/README.md, step 3d); those are held as
strict expected failures."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from testkit import agent_turns, demo_acts

pytestmark = pytest.mark.slow
MODEL = "mlx-dspark-demo"
# The shipped demo does not choose among offered tools yet, one answer of five after a tool's
# result runs on, and it answers the agents' own requests with Python until its cap
# (training/README.md, step 3d). Strict: a demo that meets a bar turns its test
# into a failure until the mark is removed, and the bar then pins it.
NOT_YET = pytest.mark.xfail(strict=True, reason="issue 41: the shipped demo does not meet this "
                                                "bar yet (training/README.md, step 3d)")


@pytest.fixture(scope="module")
def served():
    engine, client = demo_acts.served()
    yield client
    engine.stop()


@pytest.fixture(scope="module")
def tool_rows(served):
    return demo_acts.tool_checks(served, MODEL)


@NOT_YET
def test_the_demo_calls_the_named_tool_with_the_named_argument_on_held_out_tools(tool_rows):
    right = [r["request"] for r in tool_rows if r["right"]]
    assert len(right) >= 4, tool_rows


def test_a_forced_call_closes_within_64_tokens(tool_rows):
    for r in tool_rows:
        assert r["forced_closed"] and r["forced_tokens"] <= demo_acts.CALL_TOKENS, r


@NOT_YET
def test_after_a_tool_result_the_answer_stops_within_128_tokens(tool_rows):
    for r in tool_rows:
        assert r["answer_finish"] == "stop" and r["answer_tokens"] < demo_acts.ANSWER_TOKENS, r
        assert r["answer"].strip(), r


def test_thinking_writes_a_thought_and_closes_it_within_64_tokens_then_answers(served):
    for r in demo_acts.thinking_checks(served, MODEL):
        assert r["closed"], r


@pytest.fixture(scope="module")
def loops():
    return demo_acts.loop_checks(md.load())


def test_greedy_text_on_the_example_and_held_out_prompts_does_not_loop(loops):
    assert loops["worst"] >= 0.5 and loops["mean"] >= 0.7, loops["each"]
    assert len(loops["each"]) == len(demo_acts.EXAMPLE_CHATS) + 1 + len(demo_acts.EXAMPLE_RAW) \
        + len(demo_acts.CHAT_PROMPTS) and len(demo_acts.CHAT_PROMPTS) == 20


def test_dspark_keeps_at_least_2_3_tokens_per_round_on_those_prompts(loops):
    assert loops["tokens_per_round"] >= 2.3, loops


@pytest.fixture(scope="module")
def agent_rows():
    engine, client = demo_acts.served(cache_bytes=256 << 20)    # the agents' long prefixes, once
    yield agent_turns.agent_checks(client)
    engine.stop()


@NOT_YET
def test_codex_and_opencode_requests_get_their_own_tool_called_with_what_the_user_named(agent_rows):
    right = [r["request"] for r in agent_rows if r["right"]]
    assert len(right) >= len(agent_rows) - 1 and len(agent_rows) == 6, agent_rows


@NOT_YET
def test_after_an_agent_tool_result_a_short_answer_ends(agent_rows):
    for r in agent_rows:
        assert r["answered"], r
