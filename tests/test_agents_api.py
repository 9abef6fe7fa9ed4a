"""What agents ask of the server (issue 30), in process on the scripted stand-in target: the
accepted-field rule (informational fields taken, output-changing ones a 400 naming them),
effort levels as thinking budgets, ``thinking: adaptive``, one call on ``auto``,
mid-conversation system messages and documents rendered, any model name answered and
carried, ``count_tokens``, Anthropic's "prompt is too long", and no tool-call markup leaking
from a reply cut off by ``max_tokens`` in any of the three APIs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.agent_helpers import call, client, events, scripted_engine, submitted
from mlx_dspark.serve import fields
from mlx_dspark.serve.app import create_app

ROOT = Path(__file__).resolve().parents[1]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
CLAUDE_WEATHER = {"name": "get_weather", "description": "Weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
TWO_CALLS = f"Checking.\n{call('get_weather', city='Oslo')}\n{call('get_weather', city='Rome')}"
CUT = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
        MESSAGES: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
        RESPONSES: {"input": "hi", "max_output_tokens": 200}}
TOOLS = {CHAT: [WEATHER], MESSAGES: [CLAUDE_WEATHER], RESPONSES: [RESPONSES_WEATHER]}


@pytest.fixture(scope="module")
def engine():
    engine = scripted_engine([TWO_CALLS])
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def c(engine):
    return client(engine)


def prompt_text(engine, job) -> str:
    return engine.pair.tokenizer.decode(list(job.request.prompt))


# -- the accepted-field rule -----------------------------------------------------------------

INFORMATIONAL = {"metadata": {"user_id": "u"}, "user": "u1", "store": False,
                 "service_tier": "auto", "safety_identifier": "s1", "prompt_cache_key": "k",
                 "prompt_cache_retention": "24h", "client_metadata": {"turn": "1"},
                 "verbosity": "low", "cache_control": {"type": "ephemeral"},
                 "prediction": {"type": "content", "content": "x"}, "truncation": "auto",
                 "inference_geo": "us", "modalities": ["text"], "logit_bias": {},
                 "frequency_penalty": 0, "presence_penalty": 0,
                 "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                   "keep": "all"}]}}


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize("name", sorted(INFORMATIONAL))
def test_an_informational_field_is_accepted_on_every_endpoint(c, path, name):
    r = c.post(path, json={**BASE[path], name: INFORMATIONAL[name]},
               headers={"anthropic-beta": "context-management-2025-06-27"})
    assert r.status_code == 200, r.text


REFUSED = [(CHAT, {"logit_bias": {"5": 1000}}, "logit_bias"),
           (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
           (CHAT, {"frequency_penalty": 2.5}, "frequency_penalty"),
           (RESPONSES, {"frequency_penalty": 0.5}, "frequency_penalty"),
           (CHAT, {"web_search_options": {}}, "web_search_options"),
           (MESSAGES, {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "context_management"),
           (MESSAGES, {"output_config": {"format": {"type": "json_schema"}}},
            "output_config.format"),
           (MESSAGES, {"mcp_servers": [{"type": "url", "url": "https://x"}]}, "mcp_servers"),
           (MESSAGES, {"tools": [{"type": "web_search_20250305", "name": "web_search"}],
                       "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice"),
           (RESPONSES, {"previous_response_id": "resp_1"}, "previous_response_id"),
           (RESPONSES, {"background": True}, "background"),
           (RESPONSES, {"include": ["message.output_text.logprobs"]}, "include"),
           (RESPONSES, {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice"),
           (RESPONSES, {"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
           (RESPONSES, {"input": [{"role": "user", "content": [
               {"type": "input_image", "image_url": "data:"}]}]}, "input[0].content[0]")]


@pytest.mark.parametrize("path,extra,param", REFUSED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, _, n in REFUSED])
def test_a_field_that_would_change_the_output_is_a_400_naming_it(c, path, extra, param):
    r = c.post(path, json={**BASE[path], **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["message"] if path == MESSAGES else error["param"]).find(param) >= 0, error


def test_docs_list_every_accepted_field_with_its_reason():
    docs = (ROOT / "docs" / "serve.md").read_text()
    for name in [*fields.ACCEPTED, *fields.CONDITIONAL]:
        assert f"`{name}`" in docs, name


# -- thinking --------------------------------------------------------------------------------

@pytest.mark.parametrize("path,extra,on,budget", [
    (CHAT, {"reasoning_effort": "low"}, True, 1024),
    (CHAT, {"reasoning_effort": "high", "thinking_token_budget": 7}, True, 7),
    (CHAT, {"reasoning_effort": "none"}, False, None),
    (MESSAGES, {"thinking": {"type": "adaptive"}}, True, None),
    (MESSAGES, {"thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"}},
     True, 4096),
    (MESSAGES, {"output_config": {"effort": "high"}}, False, None),
    (RESPONSES, {"reasoning": {"effort": "high", "summary": "auto"}}, True, 16384),
    (RESPONSES, {"reasoning": {"effort": "minimal"}}, True, 256),
    (RESPONSES, {"reasoning": {"effort": "none"}}, False, None)])
def test_effort_levels_are_thinking_budgets(c, engine, monkeypatch, path, extra, on, budget):
    jobs = submitted(engine, monkeypatch)
    assert c.post(path, json={**BASE[path], **extra}).status_code == 200
    request = jobs[-1].request
    assert (request.thinking is not None) == on
    assert request.thinking_token_budget == budget
    assert prompt_text(engine, jobs[-1]).endswith("<think>\n" if on else "<think></think>")


def test_an_unknown_effort_is_a_400_naming_it(c):
    r = c.post(CHAT, json={**BASE[CHAT], "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


# -- messages: system turns, documents, the billing header -------------------------------------

def test_system_turns_documents_and_the_billing_header(c, engine, monkeypatch):
    jobs = submitted(engine, monkeypatch)
    r = c.post(MESSAGES, json={**BASE[MESSAGES], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.d87;"},
        {"type": "text", "text": "You are terse."}], "messages": [
        {"role": "user", "content": [
            {"type": "document", "title": "notes.txt",
             "source": {"type": "text", "media_type": "text/plain", "data": "Oslo is cold."}},
            {"type": "text", "text": "Summarize."}]},
        {"role": "system", "content": "Agents available: none."},
        {"role": "user", "content": "Go on."}]})
    assert r.status_code == 200, r.text
    text = prompt_text(engine, jobs[-1])
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "billing" not in text
    assert "<|im_start|>user\ntitle: notes.txt\nOslo is cold.Summarize.<|im_end|>" in text
    assert "<|im_start|>system\nAgents available: none.<|im_end|>\n<|im_start|>user\nGo on." \
        in text


def test_an_image_is_a_400_naming_its_block(c):
    r = c.post(MESSAGES, json={**BASE[MESSAGES], "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]})
    assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"]


# -- tools: one call on auto, cut-off calls ----------------------------------------------------

def _calls(path, reply) -> list:
    if path == CHAT:
        return [t["function"]["name"] + t["function"]["arguments"]
                for t in reply["choices"][0]["message"].get("tool_calls") or []]
    if path == MESSAGES:
        return [b["name"] + str(b["input"]) for b in reply["content"] if b["type"] == "tool_use"]
    return [i["name"] + i["arguments"] for i in reply["output"] if i["type"] == "function_call"]


def _text(path, reply) -> str:
    if path == CHAT:
        return reply["choices"][0]["message"]["content"] or ""
    if path == MESSAGES:
        return "".join(b["text"] for b in reply["content"] if b["type"] == "text")
    return "".join(p["text"] for i in reply["output"] if i["type"] == "message"
                   for p in i["content"])


@pytest.mark.parametrize("path,single", [
    (CHAT, {"parallel_tool_calls": False}),
    (MESSAGES, {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
    (RESPONSES, {"parallel_tool_calls": False})])
def test_one_call_on_auto_ends_the_reply_after_its_first_call(c, path, single):
    two = c.post(path, json={**BASE[path], "tools": TOOLS[path]}).json()
    one = c.post(path, json={**BASE[path], "tools": TOOLS[path], **single}).json()
    assert len(_calls(path, two)) == 2
    assert _calls(path, one) == _calls(path, two)[:1] and _text(path, one) == "Checking."
    if path == CHAT:
        assert one["choices"][0]["finish_reason"] == "tool_calls"
    if path == MESSAGES:
        assert one["stop_reason"] == "tool_use" and one["stop_sequence"] is None


@pytest.fixture(scope="module")
def cut():
    engine = scripted_engine([CUT])
    yield client(engine)
    engine.stop()


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_never_leaks_its_markup(cut, path, stream):
    limit = {"max_output_tokens": 30} if path == RESPONSES else {"max_tokens": 30}
    r = cut.post(path, json={**BASE[path], **limit, "tools": TOOLS[path], "stream": stream})
    assert r.status_code == 200, r.text
    assert "<tool_call" not in r.text and "<function" not in r.text and "<parameter" not in r.text
    if not stream:
        reply = r.json()
        assert _calls(path, reply) == [] and _text(path, reply) == "Checking."
    else:
        assert "ing" in r.text          # the text before the call was streamed


# -- model names, count_tokens, prompt too long --------------------------------------------------

def test_any_model_name_is_answered_and_carried_back(c):
    for path in (CHAT, MESSAGES, RESPONSES):
        for name in ("claude-opus-4-8", "gpt-5.5", None):
            body = {**BASE[path], **({"model": name} if name else {})}
            assert c.post(path, json=body).json()["model"] == (name or "mlx-dspark-demo")


def test_models_list_openai_and_anthropic_fields_and_the_aliases(engine):
    served = client(engine, aliases=["claude-sonnet-4-5", "gpt-5.5"])
    listed = served.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert [m["id"] for m in listed["data"]] == ["mlx-dspark-demo", "claude-sonnet-4-5",
                                                 "gpt-5.5"]
    assert listed["has_more"] is False and listed["first_id"] == "mlx-dspark-demo"
    for m in listed["data"]:
        assert m["object"] == "model" and m["type"] == "model"
        assert m["display_name"] == m["id"] and re.match(r"\d{4}-\d\d-\d\dT", m["created_at"])
    assert served.get("/v1/models/claude-opus-4-8").json()["id"] == "claude-opus-4-8"
    from mlx_dspark import cli
    args = cli.build_parser().parse_args(["serve", "--alias", "claude-sonnet-4-5",
                                          "--alias", "gpt-5.5"])
    assert args.alias == ["claude-sonnet-4-5", "gpt-5.5"]


def test_count_tokens_is_the_prompt_a_message_would_have(c, engine, monkeypatch):
    jobs = submitted(engine, monkeypatch)
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "system": "Be brief.", "tools": [CLAUDE_WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "adaptive"}}
    counted = c.post("/v1/messages/count_tokens?beta=true", json=body)
    assert counted.status_code == 200, counted.text
    c.post(MESSAGES, json={**body, "max_tokens": 40})
    assert counted.json() == {"input_tokens": len(jobs[-1].request.prompt)}
    bad = c.post("/v1/messages/count_tokens", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_a_prompt_over_the_context_is_anthropics_prompt_is_too_long():
    from mlx_dspark import api
    from mlx_dspark.serve.engine import Engine
    from starlette.testclient import TestClient
    pair = api.load()
    engine = Engine(lambda: pair, max_queue=1, cache_bytes=0)
    engine.start()
    try:
        served = TestClient(create_app(engine, "demo"), base_url="http://localhost")
        r = served.post(MESSAGES, json={"max_tokens": 5, "messages": [
            {"role": "user", "content": "word " * 70000}]})
    finally:
        engine.stop()
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    m = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum \(", error["message"])
    assert m and int(m[1]) > int(m[2]) == pair.target.context_limit - 1 == 65535


def test_a_queued_stream_gets_message_start_once_its_prefix_is_restored(c):
    r = c.post(MESSAGES, json={**BASE[MESSAGES], "stream": True})
    seen = events(r.text)
    assert seen[0][0] == "message_start"
    usage = seen[0][1]["message"]["usage"]
    assert usage["input_tokens"] > 0 and usage["cache_read_input_tokens"] == 0
    delta = next(d for n, d in seen if n == "message_delta")["usage"]
    assert delta["input_tokens"] == usage["input_tokens"] and delta["output_tokens"] > 0


def test_a_client_that_leaves_stops_the_prefill_within_one_piece(monkeypatch):
    """A long prompt is prefilled in pieces of a few hundred tokens, cut at the checkpoints
    too (message ends, every 4096 tokens); a job whose client left stops after the piece it
    is in, and a retry continues from the last checkpoint reached (the first message's end)."""
    from testkit.agent_helpers import fixture, replay
    from mlx_dspark.prompt_cache.cache import CHECKPOINT_EVERY
    from testkit.scripted import ScriptedTarget
    engine = scripted_engine(["Done."], cache_bytes=64 << 20)
    pieces, first, real = [], [], ScriptedTarget.step

    def step(self, tokens, cache, **kw):
        if tokens.size > 1:
            pieces.append(tokens.size)
            job = engine.rows.members[0]
            first[:] = [min([b for b in job.boundaries if b > 0] + [CHECKPOINT_EVERY])]
            if sum(pieces) >= first[0]:
                job.cancelled.set()                 # the client leaves in this piece
        return real(self, tokens, cache, **kw)
    monkeypatch.setattr(ScriptedTarget, "step", step)
    request = fixture("claude_code")["requests"][0]
    served = client(engine)
    try:
        r = replay(served, request, stream=False)
        assert sum(pieces) == first[0] and engine.cancelled == 1    # no piece after it
        assert r.status_code == 500 and "cancelled" in r.json()["error"]["message"]
        monkeypatch.setattr(ScriptedTarget, "step", real)
        again = replay(served, request, stream=False).json()
    finally:
        engine.stop()
    assert len(pieces) > 1 and again["usage"]["cache_read_input_tokens"] == first[0]
