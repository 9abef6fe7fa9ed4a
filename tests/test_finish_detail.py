"""A generation the model's context limit ends is named so (issue 33, traps).

Before, it said ``finish: length``, like one that ``max_tokens`` ended. Now ``Stats.
finish_detail`` is "context" or "max_tokens" for a "length" run: the CLI and chat's ``/stats``
print ``finish: context``, the API's Result and Chunk carry it, the OpenAI shapes keep
``finish_reason: "length"`` and add ``finish_detail`` (and the server logs a line), and
Anthropic's ``stop_reason`` is its documented ``model_context_window_exceeded``."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

import mlx_dspark as md
from mlx_dspark import api
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request
from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.engine import Engine
from mlx_dspark.stats import Stats, format_line, format_stats
from testkit.toy import random_drafter, tiny_target

PROMPT = "def add(a, b):"


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_the_loop_names_the_context_limit_apart_from_max_tokens(speculative):
    short = tiny_target(seed=1, max_position_embeddings=12)
    drafter = random_drafter(short)
    for max_tokens, n, detail in ((100, 4, "context"), (3, 3, "max_tokens")):
        stats = Stats()
        out = list(decode(Session(short, drafter), Request(
            list(range(1, 9)), max_tokens=max_tokens, speculative=speculative), stats))
        assert len(out) == n and stats.finish_reason == "length"   # 8 + 4 = 12 positions
        assert stats.finish_detail == detail


@pytest.fixture(scope="module")
def pair():
    return md.load()


def _limited(monkeypatch, target, limit: int):
    monkeypatch.setitem(target.config.extra, "max_position_embeddings", limit)


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_the_api_and_the_printed_stats_say_context(pair, monkeypatch, speculative):
    n = len(api.make_request(pair, PROMPT).prompt)
    _limited(monkeypatch, pair.target, n + 6)
    chunks = list(md.stream_generate(pair, PROMPT, max_tokens=50, speculative=speculative))
    last = chunks[-1]
    assert len(chunks) == 6 and last.finish_reason == "length"     # n + 6 positions
    assert last.finish_detail == "context" and chunks[0].finish_detail is None
    assert "finish: context" in format_stats(last.stats)
    assert format_line(last.stats).endswith(", context]")
    res = md.generate(pair, PROMPT, max_tokens=3, speculative=speculative)
    assert (res.finish_reason, res.finish_detail) == ("length", "max_tokens")
    assert "finish: length" in format_stats(res.stats)
    assert res.stats.as_dict()["finish_detail"] == "max_tokens"


@pytest.fixture(scope="module")
def client():
    engine = Engine(api.load, max_queue=4, cache_bytes=0)
    engine.start()
    yield TestClient(create_app(engine, "demo"), base_url="http://localhost"), engine
    engine.stop()


def test_the_server_keeps_length_and_says_context(client, monkeypatch, caplog):
    client, engine = client
    n = len(api.make_request(engine.pair, PROMPT).prompt)
    _limited(monkeypatch, engine.pair.target, n + 6)
    body = {"prompt": PROMPT, "max_tokens": 50, "temperature": 0}
    # the handler on the logger itself: a server started earlier in this process (uvicorn's
    # logging config) stops mlx_dspark's records from reaching the root logger's
    logger = logging.getLogger("mlx_dspark.serve")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="mlx_dspark.serve"):
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
    finally:
        logger.removeHandler(caplog.handler)
    assert (choice["finish_reason"], choice["finish_detail"]) == ("length", "context")
    assert any("context limit" in r.getMessage() for r in caplog.records)
    cut = client.post("/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]
    assert (cut["finish_reason"], cut["finish_detail"]) == ("length", "max_tokens")
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 50,
            "temperature": 0}
    m = len(api.make_request(engine.pair, chat["messages"]).prompt)
    _limited(monkeypatch, engine.pair.target, m + 6)
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"finish_reason": "length", "finish_detail": "context"' in lines[-1]
    anthropic = client.post("/v1/messages", json=chat).json()
    assert anthropic["stop_reason"] == "model_context_window_exceeded"
    anthropic = client.post("/v1/messages", json={**chat, "max_tokens": 2}).json()
    assert anthropic["stop_reason"] == "max_tokens"
