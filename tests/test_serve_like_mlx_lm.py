"""``mlx-dspark serve`` as an mlx-lm user expects it (issue 25, item 5): request defaults from
the flags or the model's generation_config.json, the model named by any of the names it was
started with, ``GET /v1/models/{id}``, a busy port refused before the model loads, a start
banner, and a warning when it listens beyond this machine without a key. In-process (starlette's
test client on a real engine) where no process is needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_dspark import api, cli
from mlx_dspark.cli.commands import model_names, serve_defaults
from mlx_dspark.serve.engine import Engine
from mlx_dspark.serve.app import create_app
from testkit.server import launch

DEMO = Path(api.__file__).parent / "demo"
PROMPT = "def fibonacci(n):\n"


def args_of(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.fixture(scope="module")
def engine(pair):
    engine = Engine(lambda: pair, max_queue=4, cache_bytes=0)
    engine.start()
    yield engine
    engine.stop()


def test_defaults_come_from_the_flags_else_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300}))
    assert serve_defaults(args_of(), tmp_path) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert serve_defaults(args_of("--temp", "0", "--top-k", "0", "-m", "9",
                                  "--chat-template-args", '{"enable_thinking": false}'),
                          tmp_path) == {"temperature": 0.0, "top_p": 0.95, "top_k": 0,
                                        "max_tokens": 9,
                                        "chat_template_kwargs": {"enable_thinking": False}}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert serve_defaults(args_of(), tmp_path) == {"temperature": 0.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert serve_defaults(args_of(), tmp_path) == {}               # none given: OpenAI's


def test_the_demo_serves_greedy_unless_a_flag_or_the_request_says_otherwise(pair):
    """Issue 41: the demo's generation_config.json says greedy, so the README's curl example
    (no temperature) gets generate()'s greedy text; ``--temp`` overrides the file and a
    request's own field overrides both."""
    assert serve_defaults(args_of(), DEMO / "target") == {"temperature": 0.0}
    assert serve_defaults(args_of("--temp", "0.7", "--top-p", "0.9"), DEMO / "target") == {
        "temperature": 0.7, "top_p": 0.9}
    engine = Engine(lambda: pair, max_queue=4, cache_bytes=0)
    engine.start()
    try:
        def answer(defaults, **fields):
            client = TestClient(create_app(engine, "m", defaults=defaults),
                                base_url="http://localhost")
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24,
                                                     **fields})
            return r.json()["choices"][0]["text"]
        greedy = api.generate(pair, PROMPT, max_tokens=24, temperature=0.0).text
        sampled = api.generate(pair, PROMPT, max_tokens=24, temperature=1.0, seed=3).text
        assert greedy != sampled
        assert answer(serve_defaults(args_of(), DEMO / "target")) == greedy
        hot = serve_defaults(args_of("--temp", "1"), DEMO / "target")
        assert answer(hot, seed=3) == sampled
        assert answer(hot, temperature=0) == greedy                      # the request wins
        assert answer(serve_defaults(args_of(), DEMO / "target"), temperature=1.0,
                      seed=3) == sampled
    finally:
        engine.stop()


def test_a_default_outside_its_meaning_is_one_line_naming_the_flag(capsys):
    with pytest.raises(cli.CommandError, match=r"^--top-p must be in \[0, 1\]"):
        serve_defaults(args_of("--top-p", "7"), None)


def test_the_model_answers_to_the_name_path_and_repo_id_it_was_started_with(tmp_path):
    assert model_names(args_of(), None) == ["mlx-dspark-demo"]
    names = model_names(args_of("--model", "nvidia/Some-Model-NVFP4"), tmp_path / "cache")
    assert names[:2] == ["Some-Model-NVFP4", "nvidia/Some-Model-NVFP4"]
    assert str(tmp_path / "cache") in names


def test_models_by_id_and_defaults_applied(engine, pair):
    names = ["lightning", "~/models/lightning", "/abs/models/lightning"]
    client = TestClient(create_app(engine, names, defaults={
        "temperature": 0.0, "max_tokens": 7, "num_draft": 3, "speculative": "auto"}),
        base_url="http://localhost")                # a Host naming the server
    for name in names:
        r = client.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == "lightning"
    r = client.get("/v1/models/claude-opus-4-8")       # any other name: answered by it
    assert r.status_code == 200 and r.json()["id"] == "claude-opus-4-8"
    # greedy by the server's default, 7 tokens by its default, model named by its path
    body = {"model": "/abs/models/lightning", "prompt": PROMPT}
    got = client.post("/v1/completions", json=body).json()
    want = api.generate(pair, PROMPT, max_tokens=7, temperature=0.0)
    assert got["choices"][0]["text"] == want.text
    assert got["usage"]["completion_tokens"] == 7
    # a field the request sets wins over the default
    got = client.post("/v1/completions", json={**body, "max_tokens": 3}).json()
    assert got["usage"]["completion_tokens"] == 3


def test_server_chat_template_args_reach_the_template(engine, pair, template_calls):
    seen = template_calls(pair.tokenizer)
    client = TestClient(create_app(engine, "m", defaults={
        "chat_template_kwargs": {"enable_thinking": False, "a": 1}}),
        base_url="http://localhost")
    messages = [{"role": "user", "content": "hi"}]
    assert client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"a": 2}}).status_code == 200
    assert seen[-1]["enable_thinking"] is False and seen[-1]["a"] == 2   # the request wins


def _serve(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "mlx_dspark", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_busy_port_is_one_line_and_exit_1_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _serve("--port", str(port))       # the demo pair: refused before it loads
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"mlx-dspark serve: error: cannot listen on 127.0.0.1:{port}: "
                          f"Address already in use (another server there? pick another "
                          f"--port)\n")


@pytest.mark.slow
def test_a_wrong_model_path_is_named_before_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = _serve("--port", str(s.getsockname()[1]), "--model", "/nonexistent/model")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == "mlx-dspark serve: error: /nonexistent/model: no such model directory\n"


@pytest.mark.slow
def test_listening_beyond_this_machine_without_a_key_warns():
    out = _serve("--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent/model")
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == ("mlx-dspark serve: warning: listening on 0.0.0.0 without --api-key: "
                        "anyone who can reach this machine can use the model")
    assert lines[1].startswith("mlx-dspark serve: error: /nonexistent/model: no such model")


@pytest.mark.slow
def test_the_start_banner_says_what_where_and_with_what_memory():
    proc, url = launch(["--temp", "0.3"], stderr=subprocess.PIPE,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.terminate()
    proc.wait(15)
    first = proc.stderr.read().decode().splitlines()[0]
    port = url.rsplit(":", 1)[1]
    assert first.startswith(f"mlx-dspark serve: mlx-dspark-demo ({DEMO / 'target'}) with its "
                            f"DSpark drafter, float32, ")
    assert first.endswith(f"GB in memory, on http://127.0.0.1:{port}/v1 (request defaults: "
                          f"temperature 0.3)")


def test_agent_probes_get_the_context_and_a_200_at_the_root(engine, pair):
    """Issue 41: Codex reads a model's context window from its metadata (``context_window``;
    vLLM serves ``max_model_len``), and Claude Code probes ``HEAD /``, which got a 404."""
    client = TestClient(create_app(engine, ["lightning"], "key"), base_url="http://localhost")
    listed = client.get("/v1/models", headers={"Authorization": "Bearer key"}).json()["data"]
    one = client.get("/v1/models/lightning", headers={"Authorization": "Bearer key"}).json()
    limit = pair.target.context_limit
    assert limit == 65536                                     # the demo's config.json
    for m in (listed[0], one):
        assert m["max_model_len"] == m["context_length"] == m["context_window"] == limit
        assert m["input_modalities"] == ["text"]
    head = client.head("/")                                   # no key: a probe
    assert head.status_code == 200 and head.content == b""
    assert client.get("/").json() == {"status": "ok", "model": "lightning"}
