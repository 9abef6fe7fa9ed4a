"""`mlx-dspark serve` as a real server process on 127.0.0.1, driven by the official `openai`
client (and raw HTTP where a client would refuse to send the request), against `generate()` in
this process on the same embedded demo pair."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from mlx_dspark import api
from testkit.server import launch, stop
from mlx_dspark.text.tokenizer import prompt_ids

# a real server process per fixture: the slow lane
pytestmark = pytest.mark.slow

KEY = "test-key"
CHAT = "/v1/chat/completions"
MODEL = "mlx-dspark-demo"


def _start(*flags):
    return launch(flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def server():
    # --speculative on: seeded sampling then draws the same tokens as generate(speculative=True)
    # (under "auto" the mode, and so the draws, would follow the controller's timings)
    proc, url = _start("--api-key", KEY, "--speculative", "on")
    yield url
    stop(proc)
    out = proc.stdout.read().decode()
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pair():
    return api.load()


def _chat(client, messages, stream=False, **kw):
    """(text, finish_reason, usage, dspark stats) of one chat completion."""
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, **kw)
        return (r.choices[0].message.content, r.choices[0].finish_reason, r.usage,
                r.model_extra["dspark"])
    text, finish, usage, stats = [], None, None, None
    for c in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
        stats = (c.model_extra or {}).get("dspark", stats)
    return "".join(text), finish, usage, stats


def _complete(client, prompt, stream=False, **kw):
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for c in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append(ch.text)
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_generate(client, pair, stream):
    messages = [{"role": "user", "content": f"def read_config(path, stream={stream}):"}]
    want = api.generate(pair, messages, max_tokens=40, temperature=0)
    text, finish, usage, stats = _chat(client, messages, stream, max_tokens=40, temperature=0)
    assert text == want.text
    assert usage.completion_tokens == len(want.tokens) == 40
    assert usage.prompt_tokens == len(prompt_ids(pair.tokenizer, messages))
    assert finish == "length"
    assert stats["generated_tokens"] == 40 and stats["rounds"] > 0   # speculative stats


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_generate(client, pair, stream):
    prompt = f"import sys\n\ndef main(stream={stream}):\n"
    want = api.generate(pair, prompt, max_tokens=30, temperature=0)
    text, finish, usage = _complete(client, prompt, stream, max_tokens=30, temperature=0)
    # the demo's code may end before 30 tokens: the same finish either way
    assert (text, usage.completion_tokens, finish) == (want.text, len(want.tokens), want.stats.finish_reason)
    assert len(want.tokens) >= 16


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_sampling_equals_generate(client, pair, stream):
    messages = [{"role": "user", "content": f"class Cache{int(stream)}:"}]
    kw = dict(max_tokens=32, temperature=0.8, top_p=0.95, seed=1234)
    want = api.generate(pair, messages, speculative=True, **kw)
    text, _, usage, _ = _chat(client, messages, stream, **kw)
    assert text == want.text and usage.completion_tokens == len(want.tokens)
    other = api.generate(pair, messages, speculative=True, **dict(kw, seed=99))
    assert other.text != want.text        # the seed matters, so the match above means something


def test_stop_string_ends_the_text_as_generate_does(client, pair):
    messages = [{"role": "user", "content": "def stop_here(x):"}]
    full = api.generate(pair, messages, max_tokens=40, temperature=0).text
    stop = full[15:18]
    want = api.generate(pair, messages, max_tokens=40, temperature=0, stop=[stop])
    text, finish, _, _ = _chat(client, messages, max_tokens=40, temperature=0, stop=stop)
    assert (text, finish) == (want.text, "stop") and stop not in text


def test_eight_concurrent_clients_each_get_their_own_answer(client, pair):
    prompts = [[{"role": "user", "content": f"def task_{i}(items, limit={i}):"}]
               for i in range(8)]
    want = [api.generate(pair, m, max_tokens=24, temperature=0).text for m in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: _chat(client, m, stream=True, max_tokens=24,
                                            temperature=0)[0], prompts))
    assert got == want


def test_later_turns_reuse_the_prefix_and_equal_a_cold_start(client, pair):
    messages = [{"role": "user", "content": "def load_table(name):"}]
    for turn in range(3):
        text, _, usage, stats = _chat(client, messages, max_tokens=24, temperature=0)
        cold = api.generate(pair, messages, max_tokens=24, temperature=0)
        assert text == cold.text, f"turn {turn}"
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == stats["reused_tokens"]
        if turn:
            # at least the previous turn's prompt was held (all but its last token: the
            # prompt cache keeps the state before it), and only the rest was prefilled
            assert cached >= len(prompt_ids(pair.tokenizer, messages[:-2])) - 1, f"turn {turn}"
        else:
            assert cached == 0
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"now the version {turn + 2}"}]


# about 4,000 tokens of text, and no message boundary in it
LONG = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(220))


def test_the_same_long_completion_twice_reuses_all_but_its_last_token(client, pair):
    """Issue 33: a completion has no message boundary, so nothing was kept but the states
    after the prompt and the answer, neither a proper prefix of the same prompt again:
    `cached 0` both times. The prompt cache now keeps the state before the last token."""
    want = api.generate(pair, LONG, max_tokens=12, temperature=0).text   # no cache at all
    n = len(pair.tokenizer.encode(LONG, add_special_tokens=False))
    assert n > 3900
    for turn in range(2):
        text, _, usage = _complete(client, LONG, max_tokens=12, temperature=0)
        assert text == want, f"turn {turn}"
        assert usage.prompt_tokens == n
        assert usage.prompt_tokens_details.cached_tokens == (n - 1 if turn else 0)


def test_a_single_message_chat_repeated_reuses_its_prompt(client, pair):
    messages = [{"role": "user", "content": "def repeated_question(a, b):"}]
    want = api.generate(pair, messages, max_tokens=16, temperature=0).text
    n = len(prompt_ids(pair.tokenizer, messages))
    for turn in range(2):
        text, _, usage, _ = _chat(client, messages, stream=bool(turn), max_tokens=16,
                                  temperature=0)
        assert text == want, f"turn {turn}"
        assert usage.prompt_tokens_details.cached_tokens == (n - 1 if turn else 0)


def _health(url):
    return httpx.get(url + "/health", timeout=5).json()


def _cancelled(url, before, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _health(url)["cancelled"] > before:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _long_stream(url, headers=None):
    """A long streamed request, open once its first token has arrived: yields its other
    lines; leaving the block hangs up."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "import os"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", url + CHAT, json=body, headers=headers) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: {")
        yield lines


def test_client_leaving_mid_stream_cancels_it_and_the_next_request_is_unaffected(
        server, client, pair):
    before = _health(server)["cancelled"]
    with _long_stream(server):
        pass                                    # hang up after the first token
    assert _cancelled(server, before), "the generation went on after the client left"
    messages = [{"role": "user", "content": "def after_hangup():"}]
    want = api.generate(pair, messages, max_tokens=20, temperature=0).text
    assert _chat(client, messages, max_tokens=20, temperature=0)[0] == want


def test_full_queue_answers_503_and_serving_resumes():
    proc, url = _start("--max-batch", "1", "--max-queue", "0", "--prefix-cache-mb", "0")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with _long_stream(url, headers={}):
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert e.value.status_code == 503
            assert e.value.body["code"] == "server_busy"
        deadline = time.monotonic() + 15     # the hung-up stream stops at its next token
        while True:
            try:
                r = c.completions.create(model=MODEL, prompt="x", max_tokens=2)
                break
            except openai.APIStatusError as e:
                assert e.status_code == 503 and time.monotonic() < deadline
                time.sleep(0.1)
        assert r.usage.completion_tokens == 2 and r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stop(proc)


# ---------------------------------------------------------------------------------------------
# Errors: OpenAI error objects naming the field, never a traceback, and the server keeps going


USER = [{"role": "user", "content": "hi"}]
BAD = [
    (CHAT, b"{not json", None, None),
    (CHAT, b"[1, 2]", None, None),
    (CHAT, {"model": MODEL}, "messages", None),
    (CHAT, {"model": MODEL, "messages": []}, "messages", None),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages", None),
    (CHAT, {"model": MODEL, "messages": ["hi"]}, "messages[0]", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]", None),
    (CHAT, {"model": 4, "messages": USER}, "model", None),
    (CHAT, {"model": MODEL, "messages": USER, "temperature": "hot"}, "temperature", None),
    (CHAT, {"model": MODEL, "messages": USER, "temperature": 2.5}, "temperature", None),
    (CHAT, {"model": MODEL, "messages": USER, "top_p": 0}, "top_p", None),
    (CHAT, {"model": MODEL, "messages": USER, "top_p": 1.5}, "top_p", None),
    (CHAT, {"model": MODEL, "messages": USER, "top_k": -1}, "top_k", None),
    (CHAT, {"model": MODEL, "messages": USER, "top_k": 2.5}, "top_k", None),
    (CHAT, {"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens", None),
    (CHAT, {"model": MODEL, "messages": USER, "max_tokens": True}, "max_tokens", None),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": "9"},
     "max_completion_tokens", None),
    (CHAT, {"model": MODEL, "messages": USER, "seed": -1}, "seed", None),
    (CHAT, {"model": MODEL, "messages": USER, "stop": 7}, "stop", None),
    (CHAT, {"model": MODEL, "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    (CHAT, {"model": MODEL, "messages": USER, "stop": [""]}, "stop", None),
    (CHAT, {"model": MODEL, "messages": USER, "n": 2}, "n", None),
    (CHAT, {"model": MODEL, "messages": USER, "chat_template_kwargs": [1]},
     "chat_template_kwargs", None),
    (CHAT, {"model": MODEL, "messages": USER, "stream": "yes"}, "stream", None),
    (CHAT, {"model": MODEL, "messages": USER, "stream": True,
            "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 70000}]},
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt", None),
    ("/v1/completions", {"model": MODEL}, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 4096]}, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 65536}, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,param,code", BAD,
                         ids=[f"{i}-{p or 'body'}" for i, (_, _, p, _) in enumerate(BAD)])
def test_bad_request_gets_400_naming_the_field(server, path, body, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code,
                                                              "invalid_request_error")
    assert error["message"] and "Traceback" not in r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}])
def test_missing_or_wrong_api_key_gets_401(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", CHAT)]:
        r = httpx.request(method, server + path, headers=headers, json={"messages": USER})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").status_code == 200     # health needs no key


def test_unknown_route_gets_an_openai_error_object(server):
    r = httpx.get(server + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_server_keeps_serving_after_errors(client, server):
    for body in (b"{", b"[]", b'{"messages": []}'):
        httpx.post(server + CHAT, content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _chat(client, USER, max_tokens=3, temperature=0)[2].completion_tokens == 3


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_signal_with_a_stream_in_flight_ends_it_and_exits_cleanly(sig, status):
    proc, url = _start()
    with _long_stream(url, headers={}) as lines:
        proc.send_signal(sig)
        rest = list(lines)
    assert json.loads(rest[-2][len("data: "):])["error"]["message"] == \
        "the server is shutting down"
    assert rest[-1] == "data: [DONE]" and len(rest) < 50     # stopped at the next token
    assert proc.wait(15) == status
    assert "Traceback" not in proc.stdout.read().decode()


def test_missing_model_directory_is_one_line_and_exit_1(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlx_dspark.cli", "serve", "--model",
                        str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"mlx-dspark serve: error: {tmp_path / 'nowhere'}: no such model directory"]
