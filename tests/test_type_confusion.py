"""A client's wrong type is never a 500 (issue 43, item 6): valid bodies of the five POST
routes, each field at every depth replaced by values of the other JSON types (null, integer,
float, boolean, string, array, object, nested), sent to one in-process server on the
scripted stand-in target. Every answer is a 200 (the confused body still means something)
or a 400 in the route's error shape naming a JSON path of the body; never a 500."""

from __future__ import annotations

import copy
import json
import re

import pytest

from starlette.testclient import TestClient

from testkit.agent_helpers import call, scripted_engine
from mlx_dspark.serve.app import create_app

SHELL_SCHEMA = {"type": "object", "required": ["command"],
                "properties": {"command": {"type": "string"}}}
CHAT = {
    "model": "m", "max_tokens": 2, "temperature": 0, "top_p": 1, "top_k": 0, "seed": 1,
    "stop": ["\n\n"], "logprobs": True, "top_logprobs": 1, "stream": False,
    "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
    "chat_template_kwargs": {"enable_thinking": False}, "logit_bias": {"5": 1},
    "parallel_tool_calls": True, "tool_choice": "auto", "repetition_penalty": 1.1,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "shell", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
    "tools": [{"type": "function", "function": {"name": "shell", "description": "Run.",
                                                "parameters": SHELL_SCHEMA}}]}
COMPLETION = {"model": "m", "prompt": "Once", "max_tokens": 2, "temperature": 0.5,
              "seed": 3, "logprobs": 1, "stop": "\n", "presence_penalty": 0.5,
              "response_format": {"type": "json_schema", "json_schema": {
                  "name": "n", "schema": {"type": "object"}}}}
RESPONSES = {
    "model": "gpt-5", "instructions": "Be brief.", "max_output_tokens": 2,
    "temperature": 1, "top_p": 0.9, "reasoning": {"effort": "low", "summary": "auto"},
    "include": ["reasoning.encrypted_content"], "store": False, "parallel_tool_calls": False,
    "text": {"format": {"type": "text"}}, "tool_choice": "auto",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell",
         "arguments": "{\"command\": \"ls\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "note", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "done"}]},
        {"role": "assistant", "content": "Ok."}],
    "tools": [{"type": "function", "name": "shell", "parameters": SHELL_SCHEMA},
              {"type": "custom", "name": "note", "description": "A note.",
               "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,5}"}}]}
MESSAGES = {
    "model": "claude-x", "max_tokens": 2, "temperature": 0.5, "top_k": 5,
    "stop_sequences": ["END"], "system": [{"type": "text", "text": "Be brief."}],
    "thinking": {"type": "enabled", "budget_tokens": 4}, "output_config": {"effort": "low"},
    "metadata": {"user_id": "u"},
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "document", "title": "t",
                                      "source": {"type": "text", "data": "d"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "ok"}]}]}],
    "tools": [{"name": "shell", "description": "Run.", "input_schema": SHELL_SCHEMA}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
COUNT = {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "metadata")}
# (route, valid body): the bodies above, and the other shapes of their fields
BODIES = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {}, "tool_choice": {
        "type": "function", "function": {"name": "shell"}}}),
    ("/v1/completions", COMPLETION),
    ("/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 1, "logprobs": 0}),
    ("/v1/responses", RESPONSES),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "tools": RESPONSES["tools"],
                       "tool_choice": {"type": "allowed_tools", "mode": "required",
                                       "tools": [{"type": "function", "name": "shell"}]}}),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2,
                       "text": {"format": {"type": "json_schema", "name": "n",
                                           "schema": {"type": "object"}}},
                       "tools": [{"type": "custom", "name": "note"}],
                       "tool_choice": "none"}),
    ("/v1/messages", MESSAGES),
    ("/v1/messages", {**MESSAGES, "system": "Be brief.", "thinking": {"type": "disabled"},
                      "tool_choice": {"type": "tool", "name": "shell"},
                      "messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "Sure"}]}),
    ("/v1/messages/count_tokens", COUNT),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "d"}]}}]}]}),
]
ROUTES = {route for route, _ in BODIES}
OTHERS = [None, 0, -7, 2.5, True, False, "x", "", [], [1, 2, 3], ["a"], {}, {"k": "v"},
          [[{"type": []}]], {"type": {"role": [None]}}]


def paths(value, at=()):
    """Every place in ``value`` (a path of keys and indices), the deepest last."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield at + (key,)
        yield from paths(child, at + (key,))


def replaced(body: dict, path: tuple, new) -> dict:
    out = copy.deepcopy(body)
    place = out
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = new
    return out


def confused(body: dict):
    """(path, body) for every place of ``body`` given every value of another JSON type."""
    for path in paths(body):
        old = replaced(body, path, None)
        place = body
        for key in path:
            place = place[key]
        for new in OTHERS:
            if type(new) is not type(place) or new != place:
                yield path, replaced(old, path, new)


CASES = [(route, path, body) for route, valid in BODIES for path, body in confused(valid)]


@pytest.fixture(scope="module")
def http():
    engine = scripted_engine([f"Sure.\n{call('shell', command='ls')}", "Done."])
    try:
        # a server error comes back as the 500 a client would get, not raised here
        # (a body whose max_tokens is confused away stops at the server's default)
        yield TestClient(create_app(engine, "mlx-dspark-demo", defaults={"max_tokens": 4}),
                         base_url="http://localhost", raise_server_exceptions=False)
    finally:
        engine.stop()


def named_path(route: str, body: dict, error: dict) -> str:
    """The JSON path a 400 names: OpenAI's ``param``; in Anthropic's shape the message
    starts with it."""
    if route.startswith("/v1/messages"):
        assert error["type"] == "invalid_request_error", error
        return re.match(r"'?([\w.\[\]]*)", error["message"]).group(1)
    return error["param"]


def test_there_are_over_two_thousand_confused_bodies():
    assert len(CASES) >= 2000, len(CASES)
    assert {route for route, _, _ in CASES} == set(ROUTES)


def test_the_valid_bodies_are_answered(http):
    for route, body in BODIES:
        r = http.post(route, json=body)
        assert r.status_code == 200, (route, r.text)


def test_a_type_confused_body_is_never_a_500_and_its_400_names_a_path(http):
    failures = []
    for route, path, body in CASES:
        r = http.post(route, json=body)
        if r.status_code == 200:
            continue
        error = r.json().get("error") or {}
        where = named_path(route, body, error) if r.status_code == 400 else None
        top = re.split(r"[.\[]", where or "", maxsplit=1)[0]
        if r.status_code != 400 or top not in body:
            failures.append((route, path, r.status_code, json.dumps(error)[:200]))
    assert not failures, f"{len(failures)} of {len(CASES)}:\n" + \
        "\n".join(map(str, failures[:40]))
