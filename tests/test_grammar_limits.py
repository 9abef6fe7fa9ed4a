"""Grammars that cannot hurt the server (mlx_dspark/grammar/limits.py, docs/grammar.md
"Limits"), in process: the app on the demo pair through starlette's test client, and the
Python API.

* A schema past the limits (a ``$ref`` chain of ~920 links, which overflowed llguidance's
  stack and killed the process; too deep, too large, too many tool parameters) is a 400
  naming the limit, and llguidance is never reached: it is replaced by a stub that fails the
  test, so these cases cannot take the runner down (tests/test_server_grammar.py sends the
  chain to a real server process).
* The grammar compiles off the event loop, after the context check, within a time limit.
* Every grammar error is a 400 with its whole message; every constraint of a tool's string
  parameter is enforced or refused; a stop string under a grammar never cuts the answer.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import llguidance
import pytest
from starlette.testclient import TestClient

import mlx_dspark as md
from mlx_dspark.grammar import grammars as G
from mlx_dspark.grammar import limits as grammar_limits
from mlx_dspark.request import RequestError
from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.engine import Engine

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
ASK = [{"role": "user", "content": "def f(x):"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def ref_chain(links: int = 920) -> dict:
    """The issue's schema: each definition an object whose one property refers to the next
    (~97 KB as JSON)."""
    defs = {f"node{i}": {"type": "object", "required": ["next"],
                         "properties": {"next": {"$ref": f"#/$defs/node{i + 1}"}}}
            for i in range(links)}
    defs[f"node{links}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/node0"}


def tool(parameters: dict, name: str = "f") -> list:
    return [{"type": "function", "function": {"name": name, "parameters": parameters}}]


def one_parameter(spec: dict) -> dict:
    return {"type": "object", "required": ["x"], "properties": {"x": spec}}


@pytest.fixture(scope="module")
def pair():
    return md.load()


@pytest.fixture(scope="module")
def app():
    engine = Engine(md.load, max_queue=4, cache_bytes=0)
    engine.start()
    yield create_app(engine, "demo")
    engine.stop()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def no_llguidance(monkeypatch):
    """llguidance replaced by a stub: a case that reaches it fails instead of crashing."""
    class Unreachable:
        def __getattr__(self, name):
            raise AssertionError(f"llguidance was reached (LLMatcher.{name})")

        def __call__(self, *args, **kwargs):
            raise AssertionError("llguidance was reached (LLMatcher)")

    monkeypatch.setattr(llguidance, "LLMatcher", Unreachable())


def refused(r, param: str | None = None, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err.get("param", param) == param, err
    return err["message"]


def post(client, body: dict, path: str = CHAT):
    return client.post(path, json={"messages": ASK, "max_tokens": 40, "temperature": 0,
                                   **body})


def call_arguments(r) -> dict:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    return json.loads(call["function"]["arguments"])


# ---------------------------------------------------------------------------------------------
# Limits, before llguidance


CHAIN_REQUESTS = {
    "response_format": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "chain", "schema": ref_chain()}}}),
    "tool_choice": (CHAT, {"tools": tool(one_parameter(ref_chain())),
                           "tool_choice": "required"}),
    "anthropic any": (MESSAGES, {"tools": [{"name": "f",
                                            "input_schema": one_parameter(ref_chain())}],
                                 "tool_choice": {"type": "any"}}),
}


@pytest.mark.parametrize("case", CHAIN_REQUESTS)
def test_a_920_link_ref_chain_is_a_400_naming_the_limit(client, no_llguidance, case):
    path, body = CHAIN_REQUESTS[case]
    r = post(client, body, path)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]      # OpenAI's and Anthropic's error shapes alike
    assert "$refs followed" in message and str(grammar_limits.MAX_RESOLVED_DEPTH) in message
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("keyword", ["grammar", "response_format"])
def test_the_python_api_refuses_the_ref_chain_before_llguidance(pair, no_llguidance, keyword):
    value = ref_chain() if keyword == "grammar" else \
        {"type": "json_schema", "json_schema": {"schema": ref_chain()}}
    with pytest.raises(RequestError, match=r"\$refs followed .* limit of 256") as e:
        md.generate(pair, "x", 4, **{keyword: value})
    assert e.value.param == keyword


def test_a_ref_cycle_counts_every_schema_on_it(no_llguidance):
    ring = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % 300}"} for i in range(300)}
    with pytest.raises(RequestError, match="302 levels"):
        G.json_schema({"$defs": ring, "$ref": "#/$defs/d0"})


def test_a_recursive_schema_within_the_limits_still_constrains(pair):
    tree = {"$defs": {"node": {"type": "object", "additionalProperties": False,
                               "required": ["v"],
                               "properties": {"v": {"type": "integer", "maximum": 9},
                                              "kids": {"type": "array", "maxItems": 2,
                                                       "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    out = md.generate(pair, "def f(x):", 60, grammar=tree)
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), tree)
    assert out.text.startswith('{"v":')


def nested(levels: int) -> dict:
    schema = {}
    for _ in range(levels):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"a": {"enum": ["x" * 300] * 1000}}},
     f"more than the limit of {grammar_limits.MAX_GRAMMAR_BYTES}"),
    (nested(40), "nests 41 levels deep"),
    (nested(5000), "nests 5001 levels deep"),        # deeper than json.dumps can write
])
def test_a_schema_too_large_or_too_deep_is_refused_before_llguidance(pair, no_llguidance,
                                                                       schema, says):
    with pytest.raises(RequestError, match=says):
        md.generate(pair, "x", 4, grammar=schema)


def test_forced_tool_calls_hold_at_most_so_many_parameters(no_llguidance):
    many = {f"p{i}": {"type": "integer"} for i in range(grammar_limits.MAX_TOOL_PARAMETERS + 1)}
    with pytest.raises(RequestError, match="1001 parameters, more than the limit of 1000"):
        G.tool_calls(tool({"type": "object", "properties": many}))


# ---------------------------------------------------------------------------------------------
# Where and how long llguidance runs


def test_a_prompt_past_the_context_is_refused_before_its_grammar_is_built(client,
                                                                         monkeypatch):
    def unreachable(*args, **kwargs):
        raise AssertionError("the grammar was built before the context check")

    monkeypatch.setattr(G, "tool_calls", unreachable)
    props = {f"p{i}": {"type": "integer"} for i in range(3000)}   # ~40,000 prompt tokens
    r = post(client, {"tools": tool({"type": "object", "properties": props}),
                      "tool_choice": "required"})
    assert refused(r, "messages").startswith("the prompt has")
    assert r.json()["error"]["code"] == "context_length_exceeded"


# 2000 integer ranges: 2-3 s of compiling on this 2-core machine when quiet (several times
# that under load), within the limits on size and nesting.
SLOW = {"type": "object", "properties": {
    f"p{i}": {"type": "integer", "minimum": i * 7919, "maximum": i * 104729 + 99991}
    for i in range(2000)}}


@pytest.fixture
def held(monkeypatch):
    """Every grammar compilation waits on its compiler thread until the test releases it:
    one as slow as the test needs on any machine, loaded or not (events, not durations)."""
    started, release = threading.Event(), threading.Event()
    real = grammar_limits.compiled

    def compiled(work, *args, **kw):
        def held_work(*a):
            started.set()
            release.wait()
            return work(*a)
        return real(held_work, *args, **kw)

    monkeypatch.setattr(grammar_limits, "compiled", compiled)
    yield started, release
    release.set()


def test_a_grammar_compiles_off_the_event_loop(client, monkeypatch, held):
    started, release = held
    monkeypatch.setattr(grammar_limits, "COMPILE_SECONDS", 120.0)
    done, health = [], []
    slow = threading.Thread(target=lambda: done.append(client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW}}})))
    slow.start()
    assert started.wait(120)                # compiling, until /health has answered
    asking = threading.Thread(target=lambda: health.append(client.get("/health").status_code))
    asking.start()
    asking.join(120)        # only a guard: a compilation on the event loop never lets it answer
    answered = list(health)
    release.set()
    slow.join()
    asking.join()
    assert answered == [200]
    assert done[0].status_code == 200, done[0].text


def test_a_compilation_past_the_time_limit_is_a_400(client, monkeypatch, held):
    monkeypatch.setattr(grammar_limits, "COMPILE_SECONDS", 0.3)
    r = post(client, {"response_format": {"type": "json_schema",
                                          "json_schema": {"name": "slow", "schema": SLOW}}})
    assert "took longer than the limit of 0.3 s" in refused(r, "response_format")


def test_no_free_compiler_is_a_503(client, monkeypatch):
    monkeypatch.setattr(grammar_limits, "COMPILE_SECONDS", 0.2)
    monkeypatch.setattr(grammar_limits, "_places", threading.BoundedSemaphore(1))
    grammar_limits._places.acquire()
    r = post(client, {"response_format": {"type": "json_object"}})
    assert "compiler" in refused(r, status=503)
    assert r.headers["retry-after"] == "1"


# ---------------------------------------------------------------------------------------------
# Every grammar error a 400, whole


def test_required_that_is_not_an_array_is_a_400(client):
    r = post(client, {"tools": tool({"type": "object", "properties": {"a": {}},
                                     "required": 5}), "tool_choice": "required"})
    at = "tools[0].function.parameters.required"      # named by the reader, to the field
    assert f"'{at}' must be an array of parameter names, not 5" in refused(r, at)


def test_a_regex_error_keeps_its_whole_message(client):
    r = post(client, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(["}}}})
    message = refused(r, "response_format")
    assert "regex parse error" in message and "unclosed character class" in message


LEXER_LIMIT = {"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"type": "string", "pattern": "^(x{1000}){1000}$"}}}


def test_a_grammar_past_a_limit_of_llguidance_mid_answer_is_a_400(client):
    r = post(client, {"response_format": LEXER_LIMIT})
    assert refused(r, "response_format") == \
        "JSON schema: lexer error: too many expressions constructed"
    assert post(client, {"max_tokens": 3}).status_code == 200     # the engine goes on


def test_streamed_it_ends_with_the_same_error_event(client):
    with client.stream("POST", CHAT, json={"messages": ASK, "max_tokens": 40, "stream": True,
                                           "response_format": LEXER_LIMIT}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["message"].endswith("too many expressions constructed")


def test_the_python_api_raises_a_grammar_error_with_its_whole_message(pair):
    with pytest.raises(G.GrammarError, match="too many expressions constructed") as e:
        md.generate(pair, "x", 40, response_format=LEXER_LIMIT)
    assert e.value.param == "response_format"


# ---------------------------------------------------------------------------------------------
# Every constraint of a tool's string parameter enforced, or refused


@pytest.mark.parametrize("spec", [
    {"type": "string", "enum": ["<", "<=", "a < b"]},
    {"type": "string", "enum": ["up", 1, None, "down"]},
    {"type": "string", "const": "<html>"},
    {"type": "string", "minLength": 3, "maxLength": 5.0},
])
def test_a_string_parameter_holds_to_its_schema(client, spec):
    r = post(client, {"tools": tool(one_parameter(spec)), "tool_choice": "required",
                      "parallel_tool_calls": False, "max_tokens": 60})
    args = call_arguments(r)
    jsonschema.validate(args, one_parameter(spec))


@pytest.mark.parametrize("spec, says", [
    ({"type": "string", "enum": [1, 2]}, "no string satisfies"),
    ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer, not -1"),
    ({"type": "string", "maxLength": 1.5}, "maxLength must be a non-negative integer, not 1.5"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "minLength 4 is more than maxLength 2"),
    ({"type": "string", "pattern": "^[0-9]+$"}, "'pattern' is not enforced"),
    ({"type": "string", "format": "uri"}, "'format' is not enforced"),
    ({"type": "string", "enum": ["a</parameter>"]}, "would end the value"),
    ({"type": ["string", "null"]}, "cannot be told apart"),
])
def test_a_string_constraint_that_cannot_be_held_is_a_400(client, spec, says):
    r = post(client, {"tools": tool(one_parameter(spec)), "tool_choice": "required"})
    assert says in refused(r, "tools")


@pytest.mark.parametrize("parameters, says", [
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]},
     "'b' is required but not among 'properties'"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 1},
     "'minProperties' is not enforced"),
    ({"type": "object", "properties": {"a": 3}}, "must be a JSON schema (an object)"),
])
def test_a_parameters_object_that_cannot_be_held_is_a_400(client, parameters, says):
    r = post(client, {"tools": tool(parameters), "tool_choice": "required"})
    where = "tools[0].function.parameters.properties.a" if "(an object)" in says else "tools"
    assert says in refused(r, where)


# ---------------------------------------------------------------------------------------------
# A stop string inside a constrained answer


def stopped_by_a_key(pair) -> str:
    """A stop string the demo pair's constrained answer holds: its second key."""
    return md.generate(pair, ASK, 60, chat=True, response_format=FORMAT).text.split(",")[1][:5]


FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_a_stop_string_inside_constrained_json_waits_for_the_answer_to_end(client, pair):
    stop = stopped_by_a_key(pair)
    r = post(client, {"response_format": FORMAT, "stop": [stop], "max_tokens": 60})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop in choice["message"]["content"]
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    with client.stream("POST", CHAT, json={"messages": ASK, "max_tokens": 60, "stream": True,
                                           "temperature": 0, "response_format": FORMAT,
                                           "stop": [stop]}) as s:
        pieces = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    streamed = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces
                       if p["choices"])
    assert streamed == choice["message"]["content"]


def test_the_python_api_ends_a_constrained_answer_where_it_is_complete(pair):
    stop = stopped_by_a_key(pair)
    out = md.generate(pair, ASK, 60, chat=True, response_format=FORMAT, stop=[stop])
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
