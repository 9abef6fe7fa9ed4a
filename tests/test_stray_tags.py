"""Issue 41.3: a ``<think>`` or ``</think>`` the model writes outside an open thinking block
never reaches the answer, streamed or not, in the chat, Responses and Anthropic APIs and in
the Python API; ``/v1/completions`` (text as written) keeps it. The scripted stand-in target
writes the tags through the real loop, detokenizer, engine and app: the demo tokenizer spells
``</think>`` in several tokens, so every tag arrives split across chunks."""

from __future__ import annotations

import pytest

from testkit.agent_helpers import events
from mlx_dspark import api
from mlx_dspark.serve.engine import Engine
from testkit.scripted import ScriptedTarget
from mlx_dspark.text.tokenizer import load_tokenizer
from testkit.server_helpers import app_client

STRAY = "Fix the parser.</think>\nDone <think>here."      # what aider got as a commit message
THOUGHT = "Read the parser first.</think>\n"
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
THINK_ON = {CHAT: {"chat_template_kwargs": {"enable_thinking": True}},
            MESSAGES: {"thinking": {"type": "adaptive"}},
            RESPONSES: {"reasoning": {"effort": "low"}}}
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
        MESSAGES: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
        RESPONSES: {"input": "hi", "max_output_tokens": 200}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(api.DEMO / "target")


@pytest.fixture(scope="module")
def pair(tokenizer):
    """The scripted target: :data:`STRAY`, after :data:`THOUGHT` when the prompt opened a
    thinking block."""
    def choose(ids):
        opened = tokenizer.decode(ids).endswith("<think>\n")
        return tokenizer.encode((THOUGHT if opened else "") + STRAY, add_special_tokens=False)
    return api.Pair(ScriptedTarget(4096, choose, tokenizer.eos_token_id), None, tokenizer)


@pytest.fixture(scope="module")
def c(pair):
    engine = Engine(lambda: pair, max_queue=4, cache_bytes=0, use_drafter=False)
    engine.start()
    yield app_client(engine, "mlx-dspark-demo")
    engine.stop()


def test_the_demo_tokenizer_spells_the_tags_in_pieces(tokenizer):
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1


def _whole(path, reply) -> tuple[str, str]:
    """(reasoning, text) of a reply."""
    if path == CHAT:
        m = reply["choices"][0]["message"]
        return m.get("reasoning_content") or "", m["content"] or ""
    if path == MESSAGES:
        return ("".join(b["thinking"] for b in reply["content"] if b["type"] == "thinking"),
                "".join(b["text"] for b in reply["content"] if b["type"] == "text"))
    return ("".join(p["text"] for i in reply["output"] if i["type"] == "reasoning"
                    for p in i["content"]),
            "".join(p["text"] for i in reply["output"] if i["type"] == "message"
                    for p in i["content"]))


def _streamed(path, text) -> tuple[list[str], list[str]]:
    """(reasoning pieces, text pieces) of a stream."""
    reasoning, answer = [], []
    for name, data in events(text):
        if data == "[DONE]":
            continue
        if path == CHAT:
            delta = data["choices"][0]["delta"] if data["choices"] else {}
            reasoning.append(delta.get("reasoning_content") or "")
            answer.append(delta.get("content") or "")
        elif path == MESSAGES and name == "content_block_delta":
            d = data["delta"]
            (reasoning if d["type"] == "thinking_delta" else answer).append(
                d.get("thinking") or d.get("text") or "")
        elif path == RESPONSES and name == "response.output_text.delta":
            answer.append(data["delta"])
        elif path == RESPONSES and name == "response.reasoning_text.delta":
            reasoning.append(data["delta"])
    return reasoning, answer


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize("thinking", [False, True])
def test_no_tag_outside_a_block_reaches_the_answer(c, path, thinking):
    body = {**BASE[path], **(THINK_ON[path] if thinking else {})}
    reply = c.post(path, json=body)
    assert reply.status_code == 200, reply.text
    want = ("Read the parser first." if thinking else "", "Fix the parser.\nDone here.")
    assert _whole(path, reply.json()) == want

    streamed = c.post(path, json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    reasoning, answer = _streamed(path, streamed.text)
    assert "".join(answer) == want[1] and not any("think>" in a for a in answer)
    assert "".join(reasoning) == want[0]


def test_a_completion_is_the_text_as_written(c):
    reply = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200}).json()
    assert reply["choices"][0]["text"] == STRAY


HI = [{"role": "user", "content": "hi"}]


def test_the_python_api_drops_the_stray_tags_and_split_thinking_false_keeps_them(pair):
    assert api.make_request(pair, HI).after_thinking          # the template wrote <think></think>
    res = api.generate(pair, HI, max_tokens=200)
    assert (res.reasoning, res.text) == ("", "Fix the parser.\nDone here.")
    streamed = list(api.stream_generate(pair, HI, max_tokens=200))
    assert "".join(c.text for c in streamed) == res.text
    assert not any("<" in c.text for c in streamed)      # no piece of a tag, either
    raw = api.generate(pair, HI, max_tokens=200, split_thinking=False)
    assert raw.text == STRAY


def test_a_raw_completion_is_its_text_as_written_chunk_for_chunk(pair, tokenizer):
    """A prompt no chat template framed (``generate -p ... --ignore-chat-template``) is
    completed as written: no tag read, no chunk held back."""
    assert not api.make_request(pair, "hi").after_thinking
    chunks = list(api.stream_generate(pair, "hi", max_tokens=200))
    assert "".join(c.text for c in chunks) == STRAY
    assert [c.text for c in chunks[:3]] == [tokenizer.decode([t]) for t in
                                           tokenizer.encode(STRAY, add_special_tokens=False)[:3]]


def test_a_closing_tag_inside_the_open_block_still_closes_it(pair):
    res = api.generate(pair, "hi\n<think>\n", max_tokens=200)
    assert (res.reasoning, res.text) == ("Read the parser first.", "Fix the parser.\nDone here.")
