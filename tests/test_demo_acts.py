"""The shipped demo pair acts as issue 41 asks, on held-out prompts and held-out tool sets
(testkit/demo_acts.py; `benchmarks/bench_demo_acts.py` prints the same numbers):
through the server's tool path it calls the right tool with the argument the user named, a
forced call closes, the answer after a tool's result stops; with thinking on it writes a
thought and closes it; its greedy text does not loop, and speculation with DSpark gives at least 2.3 tokens per
round on the same prompts. The shipped demo (step 3d's ab_1) meets all but the first and the
third (its numbers: training/README.md, step 3d); those two are held as strict expected failures."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from testkit import demo_acts

pytestmark = pytest.mark.slow
MODEL = "mlx-dspark-demo"
# The shipped demo does not choose among offered tools yet, and one answer of five after a tool's
# result runs on (training/README.md, step 3d). Strict: a demo that meets a bar turns its test
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
