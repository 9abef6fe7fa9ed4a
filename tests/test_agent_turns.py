"""testkit/agent_turns.py rebuilds the agents' requests as the agents sent them: the recorded
requests (testkit/agents/) come back unchanged when nothing is swapped, and a tool's output is
framed as the client framed it in the recording."""

from __future__ import annotations

import json
import re

import pytest

from testkit import agent_turns


def user_text(agent, body):
    items = body["input"] if agent == "codex" else body["messages"]
    user = next(i for i in reversed(items) if i.get("role") == "user")
    return user["content"][0]["text"] if agent == "codex" else user["content"].strip('"')


@pytest.mark.parametrize("agent", agent_turns.AGENTS)
def test_swapping_in_the_recorded_request_and_folder_gives_the_recorded_body(agent):
    rec = agent_turns.recorded(agent)
    first = rec["requests"][0]
    assert agent_turns.body_of(agent, user_text(agent, first), rec["cwd"]) == first


def the_call(agent, body):
    """The dict that holds the call's name and arguments in ``body``'s history."""
    items = body["input"] if agent == "codex" else body["messages"]
    return items[-2] if agent == "codex" else items[-2]["tool_calls"][0]["function"]


def parsed_arguments(agent, body):
    body = json.loads(json.dumps(body))
    call = the_call(agent, body)
    call["arguments"] = json.loads(call["arguments"])
    return body


@pytest.mark.parametrize("agent", agent_turns.AGENTS)
def test_the_request_after_a_result_holds_the_call_and_its_output_where_the_client_put_them(agent):
    rec = agent_turns.recorded(agent)
    after = rec["requests"][1]
    call = the_call(agent, after)
    items = after["input"] if agent == "codex" else after["messages"]
    out = items[-1]["output" if agent == "codex" else "content"]
    rebuilt = agent_turns.body_of(agent, user_text(agent, after), rec["cwd"],
                                  (call["name"], json.loads(call["arguments"])), out)
    assert parsed_arguments(agent, rebuilt) == parsed_arguments(agent, after)
    moved = agent_turns.body_of(agent, "Run `make`.", "/home/x/y", (call["name"], {"k": "make"}),
                                "made")
    assert "/home/x/y" in json.dumps(moved) and rec["cwd"] not in json.dumps(moved)
    assert user_text(agent, moved) == "Run `make`."
    assert json.loads(the_call(agent, moved)["arguments"]) == {"k": "make"}
    assert json.dumps(moved).count("made") == 1


def test_codex_output_is_framed_as_codex_framed_its_ls():
    recorded = agent_turns.recorded("codex")["requests"][1]["input"][-1]["output"]
    listing = recorded.split("Output:\n", 1)[1].removesuffix("\n")
    ours = agent_turns.framed("codex", "exec_command", listing, "/w", "")
    shape = r"Chunk ID: [0-9a-f]{6}\nWall time: \d\.\d{4} seconds\nProcess exited with code 0\n" \
            r"Original token count: \d+\nOutput:\n"
    assert re.fullmatch(shape + re.escape(listing) + r"\n", recorded)
    assert re.fullmatch(shape + re.escape(listing) + r"\n", ours)


def test_opencode_read_output_is_framed_as_opencode_framed_it():
    rec = agent_turns.recorded("opencode")
    recorded = rec["requests"][2]["messages"][-1]["content"]
    assert agent_turns.framed("opencode", "read", "# demo\n", rec["cwd"], "README.md") == recorded


def test_the_agents_tools_are_the_ones_their_requests_offer():
    for agent in agent_turns.AGENTS:
        tools = agent_turns.recorded(agent)["requests"][0]["tools"]
        offered = {t.get("name") or t.get("function", {}).get("name") for t in tools}
        for _, _, action, arg, _ in (r for r in agent_turns.AGENT_REQUESTS if r[0] == agent):
            name, args = agent_turns.call(agent, action, arg)
            assert name in offered, (agent, name)
