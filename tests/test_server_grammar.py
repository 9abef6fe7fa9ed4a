"""`response_format` and forced `tool_choice` through a real `mlx-dspark serve` process and the
official `openai` client: the answers parse and validate, and equal `generate()` in this
process with the same grammar (the server's speculative path is the library's); a `$ref`
chain past the limits is a 400 and the process lives on."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import jsonschema
import openai
import pytest

from mlx_dspark import api
from testkit.server import launch

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "year"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "required": ["key", "limit"],
                                     "properties": {"key": {"type": "string", "maxLength": 12},
                                                    "limit": {"type": "integer",
                                                              "minimum": 1}}}}}]
MESSAGES = [{"role": "user", "content": "def parse(text):"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                 "strict": True}}


@pytest.fixture(scope="module")
def server():
    proc, url = launch(("--speculative", "on"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    yield url
    proc.terminate()
    proc.wait(15)
    out = proc.stdout.read().decode()
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_and_equal_generate(client, pair, stream):
    kw = dict(model="mlx-dspark-demo", messages=MESSAGES, max_tokens=60, temperature=0,
              response_format=FORMAT)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw) if c.choices)
    else:
        reply = client.chat.completions.create(**kw)
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    local = api.generate(pair, MESSAGES, 60, chat=True, speculative="on",
                         response_format=FORMAT)
    assert text == local.text


def test_json_object_answer_is_an_object(client):
    reply = client.chat.completions.create(
        model="mlx-dspark-demo", messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "lookup"}}])
def test_forced_tool_choice_yields_a_call_whose_arguments_validate(client, choice):
    reply = client.chat.completions.create(
        model="mlx-dspark-demo", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=2,
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "lookup", message
    for _, args in calls:
        jsonschema.validate(args, TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_get_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_forced_anthropic_tool_choice_yields_a_tool_use_whose_input_validates(server):
    import anthropic
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    schema = TOOLS[0]["function"]["parameters"]
    reply = client.messages.create(
        model="mlx-dspark-demo", max_tokens=120, messages=MESSAGES,
        tools=[{"name": "lookup", "description": "Look a key up", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "lookup", \
        reply
    for use in uses:
        jsonschema.validate(use.input, schema)


def ref_chain(links: int) -> dict:
    """Definitions that each refer to the next, ~27 bytes a link."""
    defs = {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(links)}
    defs[f"n{links}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/n0"}


# Last in this module: before the limits, the first of these killed the server (SIGSEGV in
# llguidance, on the event loop) and every test after it with it. 2800 links (~75 KB, within
# what the length pre-check lets a tool bring to the demo model): deeper than the 8 MiB stack
# of the event loop's thread holds on this Linux machine (the issue saw the crash at ~920
# links of a wider shape).
CHAIN = ref_chain(2800)
CHAINS = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "chain", "schema": CHAIN}}}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": CHAIN}}}}],
        "tool_choice": "required"}),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"x": CHAIN}}}], "tool_choice": {"type": "any"}}),
]


def test_a_ref_chain_past_the_limit_is_a_400_and_the_server_lives_on(server):
    for path, body in CHAINS:
        r = httpx.post(server + path, timeout=30,
                       json={"messages": MESSAGES, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert "with its $refs followed" in r.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200
