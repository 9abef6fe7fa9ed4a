"""Real agents' requests, replayed (issue 30): what Claude Code, Codex, the OpenAI Agents SDK
and opencode sent on a tool-using turn (tests/fixtures/agents/, recorded with their own
fields and headers), against an in-process server whose scripted target writes a call to the
shell tool each declares and, once the result is back, an answer. Each turn is answered in
the client's own shapes: its model name, its tool call, its usage; and two Claude Code
sessions share their system prompt and tools in the prompt cache whatever their billing
header."""

from __future__ import annotations

import json

import pytest

from testkit.agent_helpers import THOUGHT, call, client, events, fixture, replay, scripted_engine

SHELL = {"claude_code": ("Bash", {"command": "ls", "description": "List files"}),
         "codex": ("exec_command", {"cmd": "ls"}),
         "agents_sdk": ("bash", {"command": "ls"}),
         "opencode": ("bash", {"command": "ls", "description": "List files"})}
ANSWER = "README.md is the only file here."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+print('hello')\n*** End Patch\n"


@pytest.fixture(scope="module", params=sorted(SHELL))
def turn(request):
    """(fixture name, its requests, a client of a server that calls its shell tool)."""
    name = request.param
    tool, args = SHELL[name]
    engine = scripted_engine([f"Let me look.\n{call(tool, **args)}", ANSWER])
    yield name, fixture(name)["requests"], client(engine)
    engine.stop()


def test_each_client_gets_its_tool_call_then_its_answer_in_its_own_shape(turn):
    name, requests, c = turn
    tool, args = SHELL[name]
    first, *_, last = [r for r in requests if _tools_of(r)]
    for request, want in ((first, "call"), (last, "answer")):
        r = replay(c, request)
        assert r.status_code == 200, r.text
        stream = request["body"].get("stream")
        got = _read(request["path"], r.text if stream else r.json(), stream)
        assert got["model"] == request["body"]["model"]
        if want == "call":
            assert got["calls"] == [(tool, args)] and got["text"] == "Let me look."
        else:
            assert got["calls"] == [] and got["text"] == ANSWER


def _tools_of(request) -> list:
    return request["body"].get("tools") or []


def _read(path: str, reply, stream: bool) -> dict:
    """The model name, text and calls of a reply of any of the three APIs."""
    if path.startswith("/v1/messages"):
        message = _anthropic(reply) if stream else reply
        blocks = message["content"]
        return {"model": message["model"],
                "text": "".join(b["text"] for b in blocks if b["type"] == "text"),
                "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]}
    if path == "/v1/responses":
        response = next(d["response"] for _, d in events(reply)
                        if d["type"] == "response.completed") if stream else reply
        items = response["output"]
        return {"model": response["model"],
                "text": "".join(p["text"] for i in items if i["type"] == "message"
                                for p in i["content"]),
                "calls": [(i["name"], json.loads(i["arguments"])) for i in items
                          if i["type"] == "function_call"]}
    pieces = [d for _, d in events(reply) if d != "[DONE]" and d["choices"]]
    deltas = [p["choices"][0]["delta"] for p in pieces]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    return {"model": pieces[0]["model"], "text": "".join(d.get("content") or "" for d in deltas),
            "calls": [(c["function"]["name"], json.loads(c2["function"]["arguments"]))
                      for c, c2 in zip(calls[::2], calls[1::2])]}


def _anthropic(text: str) -> dict:
    """An Anthropic stream put together the way the SDK does."""
    message, blocks = None, {}
    for name, data in events(text):
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"], partial="")
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            for key, into in (("text", "text"), ("thinking", "thinking"),
                              ("partial_json", "partial")):
                if key in delta:
                    block[into] += delta[key]
        elif name == "message_delta":
            message["usage"].update(data["usage"])
            message["stop_reason"] = data["delta"]["stop_reason"]
    for block in blocks.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"])
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message


def test_claude_codes_turn_thinks_adaptively_and_reports_honest_usage():
    requests = fixture("claude_code")["requests"]
    tool, args = SHELL["claude_code"]
    engine = scripted_engine([f"Let me look.\n{call(tool, **args)}"], cache_bytes=64 << 20)
    c = client(engine)
    try:
        replay(c, requests[0])                  # the second time, its prefix is cached
        r = replay(c, requests[0])
        count = c.post("/v1/messages/count_tokens?beta=true", json={
            k: v for k, v in requests[0]["body"].items() if k not in ("max_tokens", "stream")})
    finally:
        engine.stop()
    names = [n for n, _ in events(r.text)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    message = _anthropic(r.text)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == THOUGHT.split("</think>")[0]
    assert message["stop_reason"] == "tool_use"
    start = events(r.text)[0][1]["message"]["usage"]
    usage = message["usage"]                        # message_start's, then message_delta's
    assert start["cache_read_input_tokens"] == usage["cache_read_input_tokens"] > 10000
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        count.json()["input_tokens"]


def test_codex_gets_apply_patch_as_a_custom_call_holding_the_raw_patch():
    request = fixture("codex")["requests"][0]
    engine = scripted_engine([f"Adding the file.\n{call('apply_patch', input=PATCH)}"])
    try:
        r = replay(client(engine), request)
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    seen = events(r.text)
    kinds = [d["type"] for _, d in seen]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in seen] == list(range(len(seen)))
    assert "response.custom_tool_call_input.delta" in kinds
    items = seen[-1][1]["response"]["output"]
    assert [i["type"] for i in items] == ["reasoning", "message", "custom_tool_call"]
    assert items[-1]["name"] == "apply_patch" and items[-1]["input"] == PATCH


def test_two_claude_code_sessions_share_their_system_prompt_and_tools_whatever_the_billing_header():
    """Claude Code's first system block is ``x-anthropic-billing-header: cc_version=…`` with a
    suffix that changes with each session's first prompt; it is kept out of the prompt, so
    a second session continues from the first one's system-and-tools snapshot."""
    engine = scripted_engine([ANSWER], cache_bytes=64 << 20)
    c = client(engine)
    request = fixture("claude_code")["requests"][0]
    system = request["body"]["system"]
    assert system[0]["text"].startswith("x-anthropic-billing-header: cc_version=")
    try:
        usages = []
        for suffix, prompt in (("d87", "List the files here"), ("8a5", "What is this repo?")):
            body = dict(request["body"], stream=False, system=[
                dict(system[0], text=system[0]["text"].replace(".d87;", f".{suffix};")),
                *system[1:]])
            body["messages"] = [dict(body["messages"][0], content=[
                *body["messages"][0]["content"][:-1], {"type": "text", "text": prompt}]),
                *body["messages"][1:]]
            usages.append(replay(c, request, **body).json()["usage"])
        head = {k: v for k, v in request["body"].items() if k in ("system", "tools")}
        turn = {"messages": [{"role": "user", "content": "x"}]}
        shared = c.post("/v1/messages/count_tokens", json={**head, **turn}).json()[
            "input_tokens"] - c.post("/v1/messages/count_tokens", json=turn).json()[
            "input_tokens"]
    finally:
        engine.stop()
    assert usages[0]["cache_read_input_tokens"] == 0
    assert usages[1]["cache_read_input_tokens"] == shared > 10000     # system and tools
