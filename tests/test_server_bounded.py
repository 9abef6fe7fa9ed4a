"""Bounded work per request before shared resources, and honest text (issue 35), in process:
the app on the demo pair, driven by starlette's test client or, where a client must hang up
or read a stream as it comes, served by uvicorn on a thread of this process. The engine is held
on its first job where a test needs requests to wait in its queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest

from mlx_dspark import api
from mlx_dspark.serve import relay
from mlx_dspark.serve.engine import Job
from mlx_dspark.text.tokenizer import chat_ids
from testkit.server_helpers import app_client, served, started_engine, until

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "def greet(name):"}]


@pytest.fixture(scope="module")
def engine():
    yield from started_engine(max_queue=2)


@pytest.fixture(scope="module")
def client(engine):
    return app_client(engine, "demo")


def _until(condition, seconds=10.0) -> bool:
    return until(condition, seconds)


@pytest.fixture
def held(engine, monkeypatch):
    """The engine runs one job that waits until the test ends (or ``release()``), so that
    the requests a test sends wait in the queue."""
    gate, advance = threading.Event(), engine.rows.advance

    def held_advance():         # the batch's turns wait for the gate
        gate.wait(60)
        advance()

    monkeypatch.setattr(engine.rows, "advance", held_advance)
    blocker = Job(api.make_request(engine.pair, [1, 2, 3], max_tokens=2),
                  asyncio.new_event_loop())
    engine.submit(blocker)
    assert _until(lambda: engine.rows.members and engine.waiting == 0)
    yield gate.set
    gate.set()
    assert _until(lambda: not engine.rows.members and engine.waiting == 0)


@pytest.fixture
def url(engine):
    """The app served by uvicorn on a thread, on a free port."""
    with served(engine) as url:
        yield url


# ---------------------------------------------------------------------------------------------
# The length pre-check counts all that the template renders


def _big(engine) -> str:
    limit = engine.pair.target.context_limit
    return "a" * (limit * max(map(len, engine.pair.tokenizer.get_vocab())) + 1)


def _tool(description="", schema=None):
    return {"type": "function", "function": {"name": "f", "description": description,
                                             "parameters": schema or {"type": "object"}}}


@pytest.mark.parametrize("where", ["tool description", "schema property", "call arguments",
                                   "template variable"])
def test_tools_calls_and_template_variables_count_toward_the_length_pre_check(
        client, engine, monkeypatch, where):
    big = _big(engine)
    body = {"messages": USER, "max_tokens": 2}
    if where == "tool description":
        body["tools"] = [_tool(big)]
    elif where == "schema property":
        body["tools"] = [_tool(schema={"type": "object", "properties": {big: {}}})]
    elif where == "call arguments":
        body["messages"] = USER + [
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
             "function": {"name": "f", "arguments": json.dumps({"x": big})}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    else:
        body["chat_template_kwargs"] = {"preamble": big}
    encoded = []
    monkeypatch.setattr(engine.pair.tokenizer._tokenizer, "encode",
                        lambda *a, **k: encoded.append(1) or [1])
    r = client.post(CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not encoded, "tokenized before the check"


@pytest.mark.parametrize("where", ["tool input", "system blocks", "tool schema", "prefill"])
def test_anthropic_tool_inputs_system_blocks_and_prefill_count_too(client, engine, monkeypatch,
                                                                    where):
    big = _big(engine)
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    if where == "tool input":
        body["messages"] = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                               "input": {"x": big}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                          "content": "ok"}]}]
    elif where == "system blocks":
        body["system"] = [{"type": "text", "text": big[:len(big) // 2]},
                          {"type": "text", "text": big[len(big) // 2:]}]
    elif where == "tool schema":
        body["tools"] = [{"name": "f", "input_schema": {"type": "object",
                                                        "properties": {big: {}}}}]
    else:
        body["messages"].append({"role": "assistant", "content": big})
    encoded = []
    monkeypatch.setattr(engine.pair.tokenizer._tokenizer, "encode",
                        lambda *a, **k: encoded.append(1) or [1])
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert not encoded, "tokenized before the check"


# ---------------------------------------------------------------------------------------------
# Stop strings: bounded alike on both APIs


@pytest.mark.parametrize("path,body,param", [
    ("/v1/messages", {"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ("/v1/messages", {"stop_sequences": ["x" * 1001]}, "stop_sequences"),
    (CHAT, {"stop": "x" * 1001}, "stop"),
    (CHAT, {"stop": ["a", "x" * 1001]}, "stop")])
def test_stop_strings_are_bounded_in_count_and_length_on_both_apis(client, path, body, param):
    r = client.post(path, json={"messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert param in message and "1000" in message


def test_four_stop_sequences_of_1000_characters_are_served(client):
    r = client.post("/v1/messages", json={"messages": USER, "max_tokens": 3,
                                          "stop_sequences": ["\x01" * 1000] * 4})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3


# ---------------------------------------------------------------------------------------------
# The queue: a client that leaves frees its place at once; waiting clients hear from it


def test_a_job_that_leaves_the_queue_frees_its_place_and_the_others_move_up(engine, held):
    jobs = [Job(api.make_request(engine.pair, [1, 2], max_tokens=1), asyncio.new_event_loop())
            for _ in range(3)]
    engine.submit(jobs[0])
    engine.submit(jobs[1])
    assert [engine.position(j) for j in jobs[:2]] == [1, 2]
    with pytest.raises(Exception) as busy:           # one running, two waiting: full
        engine.submit(jobs[2])
    assert busy.value.status == 503
    engine.cancel(jobs[0])
    assert engine.waiting == 1 and engine.position(jobs[1]) == 1
    assert engine.position(jobs[0]) is None
    engine.submit(jobs[2])                           # the freed place, at once
    assert engine.position(jobs[2]) == 2


def _stream(http: httpx.Client, url: str, path: str = CHAT, **body):
    body = {"messages": USER, "max_tokens": 4, "temperature": 0, "stream": True, **body}
    return http.stream("POST", url + path, json=body)


def test_queued_clients_that_hang_up_free_their_places_for_new_ones(engine, held, url):
    with httpx.Client(timeout=30) as http:
        for _ in range(3):                  # more than the queue holds, three times over
            with contextlib.ExitStack() as waiting:
                for _ in range(2):
                    r = waiting.enter_context(_stream(http, url))
                    assert r.status_code == 200
                assert _until(lambda: engine.waiting == 2)
                with _stream(http, url) as r:
                    assert r.status_code == 503
            assert _until(lambda: engine.waiting == 0, 5), "gone clients keep their places"


def test_a_queued_non_streamed_client_that_hangs_up_frees_its_place(engine, held, url):
    body = json.dumps({"messages": USER, "max_tokens": 4}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        assert _until(lambda: engine.waiting == 1)
    assert _until(lambda: engine.waiting == 0, 5), "a gone client keeps its place"


def test_queued_streams_get_keep_alives_with_their_place(engine, held, url, monkeypatch):
    monkeypatch.setattr(relay, "KEEPALIVE_SECONDS", 0.05)
    with httpx.Client(timeout=30) as http, _stream(http, url) as first, \
            _stream(http, url, "/v1/messages") as second:
        lines = (line for line in second.iter_lines() if line)
        assert next(lines) == "event: message_start"
        next(lines)                                  # its data
        assert next(lines) == "event: ping"
        assert json.loads(next(lines).removeprefix("data: ")) == {"type": "ping",
                                                                 "queue_position": 2}
        assert next(first.iter_lines()) == ": queued, position 1"


def test_the_clients_read_through_keep_alives_to_the_same_answer(engine, held, url,
                                                                monkeypatch):
    monkeypatch.setattr(relay, "KEEPALIVE_SECONDS", 0.05)
    want = api.generate(engine.pair, USER, max_tokens=6, temperature=0).text
    got = {}

    def ask_openai():
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got["openai"] = "".join(ch.choices[0].delta.content or "" for ch in
                                c.chat.completions.create(model="demo", messages=USER,
                                                          max_tokens=6, temperature=0,
                                                          stream=True) if ch.choices)

    def ask_anthropic():
        c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with c.messages.stream(model="demo", messages=USER, max_tokens=6,
                               temperature=0) as s:
            got["anthropic"] = s.get_final_text()

    threads = [threading.Thread(target=f) for f in (ask_openai, ask_anthropic)]
    for t in threads:
        t.start()
        assert _until(lambda: engine.waiting == threads.index(t) + 1)
    time.sleep(0.5)                     # ten keep-alive intervals in the queue
    held()
    for t in threads:
        t.join(60)
    assert got == {"openai": want, "anthropic": want}


# ---------------------------------------------------------------------------------------------
# Honest text


def test_a_completion_that_opens_thinking_is_the_models_text_streamed_or_not(client, engine):
    body = {"prompt": "<think>\n", "max_tokens": 24, "temperature": 0}
    want = api.generate(engine.pair, "<think>\n", max_tokens=24, temperature=0)
    assert want.reasoning and not want.text          # all 24 tokens think
    whole = client.post("/v1/completions", json=body).json()
    streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    pieces = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["text"] for p in pieces for c in p["choices"])
    assert whole["choices"][0]["text"] == text == engine.pair.tokenizer.decode(want.tokens)
    assert whole["usage"]["completion_tokens"] == 24


def test_an_anthropic_prefill_is_continued_as_written(client, engine, monkeypatch):
    prefill = "  return f'Hello"                   # leading spaces kept, the turn left open
    sent = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda job: sent.append(job) or submit(job))
    r = client.post("/v1/messages", json={"max_tokens": 8, "temperature": 0, "messages": [
        *USER, {"role": "assistant", "content": prefill}]})
    assert r.status_code == 200, r.text
    prompt = list(sent[0].request.prompt)
    tokenizer = engine.pair.tokenizer
    opened = chat_ids(tokenizer, USER, {"enable_thinking": False})
    assert tokenizer.decode(prompt) == tokenizer.decode(opened) + prefill
    want = api.generate(engine.pair, prompt, max_tokens=8, temperature=0).text
    assert r.json()["content"][0]["text"] == want


def test_an_anthropic_prefill_with_thinking_is_refused(client):
    r = client.post("/v1/messages", json={"max_tokens": 8, "messages": [
        *USER, {"role": "assistant", "content": "Sure"}],
        "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert r.status_code == 400 and "prefill" in r.json()["error"]["message"]


@pytest.mark.parametrize("value", ["false", 1, 0, {}, None, "true"])
@pytest.mark.parametrize("name", ["enable_thinking", "thinking"])
def test_a_template_switch_must_be_a_boolean(client, name, value):
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2,
                                "chat_template_kwargs": {name: value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{name}"
    ok = client.post(CHAT, json={"messages": USER, "max_tokens": 2,
                                 "chat_template_kwargs": {name: False}})
    assert ok.status_code == 200
