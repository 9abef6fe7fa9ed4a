"""Agents against real `mlx-dspark serve` processes, driven by the official `openai` and
`anthropic` clients: tool calls (a scripted stand-in target writes chosen replies, since the
tiny demo model never writes a valid call), thinking and its budget, logprobs, the Anthropic
Messages API, and a 400 naming every field the server neither honours nor accepts."""

from __future__ import annotations

import json
import subprocess

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest

import mlx_dspark as md
from testkit.server import launch, stop

pytestmark = pytest.mark.slow

KEY = "test-key"
DEMO = "mlx-dspark-demo"
THINK = {"chat_template_kwargs": {"enable_thinking": True}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
REPLIES = [
    "The user wants weather and time; call both tools.\n</think>\nLet me look that up.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    "</tool_call>",
    "Both results are in.\n</think>\nIn Oslo it is 14:05 and sunny, 18 C, for the next two days.",
]


def _stop(proc):
    stop(proc)
    out = proc.stdout.read().decode()
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    replies = tmp_path_factory.mktemp("script") / "replies.json"
    replies.write_text(json.dumps(REPLIES))
    proc, url = launch(["--api-key", KEY], command=("testkit.scripted", str(replies)),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def demo():
    proc, url = launch(["--api-key", KEY, "--speculative", "on"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    yield url
    _stop(proc)


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


# -- tools -----------------------------------------------------------------------------------


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_tool_calls_come_typed_and_the_stream_assembles_to_the_same_answer(scripted):
    client = oai(scripted)
    ask = dict(model="scripted", messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER, TIME], extra_body=THINK)
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    want = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"city": "Oslo"})]
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls"
        assert calls_of(choice.message) == want
        assert choice.message.content == "Let me look that up."
        assert choice.message.model_extra["reasoning_content"] == \
            "The user wants weather and time; call both tools.\n"


def test_tool_choice_none_hides_the_tools_and_reads_no_calls(scripted):
    r = oai(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER, TIME], tool_choice="none", extra_body=THINK)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert "<tool_call>" in choice.message.content      # the text, as the model wrote it


def test_a_call_of_an_undeclared_function_comes_back_as_text(scripted):
    r = oai(scripted).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        extra_body=THINK)
    choice = r.choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Oslo", "days": 2})]
    assert "<function=get_time>" in choice.message.content


def agent_loop(client) -> list:
    """The client asks; the model calls two tools; the client runs them and sends the
    results; the model answers. Returns the conversation."""
    run = {"get_weather": lambda city, days=1: f"sunny, 18 C in {city} for {days} days",
           "get_time": lambda city: f"14:05 in {city}"}
    messages = [{"role": "user", "content": "What is the weather and the time in Oslo?"}]
    for _ in range(3):
        message = client.chat.completions.create(
            model="scripted", messages=messages, tools=[WEATHER, TIME],
            extra_body=THINK).choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"reasoning_content"}))
        if not message.tool_calls:
            return messages
        for c in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": run[c.function.name](**json.loads(c.function.arguments))})
    raise AssertionError("the model never answered")


def test_an_agent_loop_calls_two_tools_gets_the_results_and_answers(scripted):
    messages = agent_loop(oai(scripted))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[2]["content"] == "sunny, 18 C in Oslo for 2 days"
    assert messages[-1]["content"].startswith("In Oslo it is 14:05")


def test_the_anthropic_client_gets_tool_use_blocks_and_sends_results_back(scripted):
    client = claude(scripted)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    ask = [{"role": "user", "content": "Weather and time in Oslo?"}]
    kw = dict(model="scripted", max_tokens=300, tools=tools,
              thinking={"type": "enabled", "budget_tokens": 200})
    first = client.messages.create(messages=ask, **kw)
    with client.messages.stream(messages=ask, **kw) as stream:
        streamed = stream.get_final_message()
    for m in (first, streamed):
        assert m.stop_reason == "tool_use"
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == \
            [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"city": "Oslo"})]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
               for b in first.content if b.type == "tool_use"]
    final = client.messages.create(messages=ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in first.content]},
        {"role": "user", "content": results}], **kw)
    assert final.stop_reason == "end_turn"
    assert final.content[-1].text.startswith("In Oslo it is 14:05")


# -- the demo pair: thinking, logprobs, refusals ----------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return md.load()


def test_thinking_is_reasoning_content_and_a_budget_lets_the_model_answer(demo, pair):
    messages = [{"role": "user", "content": "def parse_args(argv):"}]
    r = oai(demo).chat.completions.create(
        model=DEMO, messages=messages, max_tokens=30, temperature=0,
        extra_body={**THINK, "thinking_token_budget": 3})
    # budget 3: the chat-tuned demo target closes its block by itself after 5 tokens (its
    # '</think>'), so the budget closes it first (tests/test_reasoning.py)
    want = md.generate(pair, messages, max_tokens=30, thinking_token_budget=3,
                       chat_template_kwargs={"enable_thinking": True})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == want.reasoning and want.reasoning
    assert message.content == want.text and want.text
    assert r.usage.completion_tokens == 30
    assert 3 <= r.usage.completion_tokens_details.reasoning_tokens < 30


def test_thinking_that_fills_max_tokens_is_length_never_an_empty_answer(demo):
    r = oai(demo).chat.completions.create(
        model=DEMO, messages=[{"role": "user", "content": "Think hard."}], max_tokens=4,
        temperature=0, extra_body=THINK)       # 4: inside the demo target's 5-token close
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == ""
    assert choice.message.model_extra["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_reasoning_effort_none_turns_thinking_off(demo):
    r = oai(demo).chat.completions.create(
        model=DEMO, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        reasoning_effort="none", extra_body=THINK)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_the_servers_template_args_are_a_default_a_request_overrides():
    proc, url = launch(["--chat-template-args", '{"enable_thinking": true}'],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ask = dict(model=DEMO, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        on = oai(url).chat.completions.create(**ask).choices[0].message
        off = oai(url).chat.completions.create(
            **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    finally:
        _stop(proc)
    assert on.model_extra["reasoning_content"] and on.content == ""
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})


def test_logprobs_are_the_targets_own_and_equal_across_modes(demo, pair):
    """The server speculates (--speculative on); the tokens equal serial decoding's and each
    log-probability equals the log-softmax of an uncached forward over the whole sequence."""
    messages = [{"role": "user", "content": "import os"}]
    r = oai(demo).chat.completions.create(model=DEMO, messages=messages, max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert r.model_extra["dspark"]["rounds"] > 0
    serial = md.generate(pair, messages, max_tokens=12, speculative=False)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == serial.text
    prompt = md.api.make_request(pair, messages).prompt
    ids = list(prompt) + serial.tokens
    logp = pair.target(mx.array([ids]))[0].astype(mx.float32)
    logp = (logp - mx.logsumexp(logp, axis=-1, keepdims=True))[len(prompt) - 1:-1]
    want = mx.take_along_axis(logp, mx.array(serial.tokens)[:, None], axis=-1)[:, 0].tolist()
    assert [e.logprob for e in content] == pytest.approx(want, abs=2e-4)
    for e in content:     # greedy: the chosen token is the most likely alternative
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob
    streamed = [e for c in oai(demo).chat.completions.create(
        model=DEMO, messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True)
        for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=2e-4)


def test_completion_logprobs_name_each_token(demo, pair):
    r = oai(demo).completions.create(model=DEMO, prompt="def main():", max_tokens=6,
                                     temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_the_anthropic_client_streams_events_in_order_and_stops_on_a_sequence(demo, pair):
    client = claude(demo)
    ask = dict(model=DEMO, max_tokens=24, temperature=0, system="You write Python.",
               messages=[{"role": "user", "content": "def read_lines(path):"}])
    whole = client.messages.create(**ask)
    text = whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 24
    with client.messages.stream(**ask) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text
    core = [n for n in names if n in ("message_start", "content_block_start",
                                      "content_block_delta", "content_block_stop",
                                      "message_delta", "message_stop")]
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    stop = text[8:11]
    cut = client.messages.create(**ask, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]


def test_the_anthropic_endpoint_wants_the_key_and_answers_errors_in_its_shape(demo):
    body = {"model": DEMO, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(demo + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    claude(demo).messages.create(**body, metadata={"user_id": "u"})     # informational
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(demo).messages.create(**body, extra_body={"mcp_servers": [{"url": "x"}]})
    assert e.value.body["type"] == "error" and "mcp_servers" in e.value.body["error"]["message"]


CHAT = [{"role": "user", "content": "hi"}]
REFUSED = [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"parallel_tool_calls": "no", "tools": [WEATHER]},
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/chat/completions", {"thinking_token_budget": -1}, "thinking_token_budget"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
    ("/v1/completions", {"logprobs": 9}, "logprobs"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED,
                         ids=[f"{p.split('/')[-1]}-{f}" for p, _, f in REFUSED])
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(demo, path, extra, param):
    body = {"model": DEMO, "max_tokens": 4, **extra,
            **({"messages": CHAT} if "chat" in path else {"prompt": "x"})}
    r = httpx.post(demo + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
