"""``serve --max-batch``: requests decoded together by the engine (serve/batching.py), each row's
answer the answer its request gets alone, a joining prompt prefilled in pieces beside the rows
decoding, a client that leaves taking only its own row, /health showing each row's phase, and
thinking budgets (OpenAI's, Anthropic's) decoded in the batch beside plain rows. Demo pair, greedy, stock BLAS."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest

from mlx_dspark import api
from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.engine import CANCELLED, Engine, Job
from mlx_dspark.serve.errors import ApiError

from testkit.server_helpers import app_client, started_engine

PROMPTS = ["def read_config(path):", "import os\n", "The quick brown fox", "class Stack:"]
LONG = 1600        # tokens: four prefill pieces


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.fixture(scope="module")
def engine(pair):
    yield from started_engine(lambda: pair, max_queue=4, max_batch=4)


@dataclass(eq=False)
class Heard(Job):
    """A job whose events go, in the order the engine emits them, into one list its test
    shares with the other jobs (``heard``): who, what, the item."""

    heard: list = field(default_factory=list)

    def emit(self, kind: str, item):
        self.heard.append((self, kind, item))


def _submit(engine, heard, request, **options) -> Heard:
    job = Heard(request, None, heard=heard, **options)
    engine.submit(job)
    return job


def _events(heard, job, kind="chunk") -> list:
    return [item for who, what, item in list(heard) if who is job and what == kind]


def _over(heard, job) -> bool:
    return any(what == "error" or what == "chunk" and item.finish_reason is not None
               for who, what, item in list(heard) if who is job)


def _until(test, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _text(chunks) -> str:
    return "".join(c.text for c in chunks)


def _index(heard, job, test) -> int:
    return next(i for i, (who, what, item) in enumerate(list(heard)) if who is job
                and test(what, item))


def _final(what, item):
    return what == "chunk" and item.finish_reason is not None


def _long_prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 1000, LONG).tolist()


def _peak(engine, record):
    """Record the batch size /health shows after every turn of the engine."""
    publish = engine.rows.publish

    def published():
        publish()
        record.append(engine.batch["size"])
    engine.rows.publish = published
    return publish


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_concurrent_requests_through_the_server_each_get_their_answer_alone(
        engine, pair, mode):
    app = create_app(engine, "demo", defaults={"speculative": mode})
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 1}
              for i, p in enumerate(PROMPTS)]

    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost",
                                     timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b)
                                          for b in bodies))
    sizes = []
    publish = _peak(engine, sizes)
    try:
        replies = asyncio.run(send())
    finally:
        engine.rows.publish = publish
    assert max(sizes) >= 2                                  # they did decode together
    for body, reply in zip(bodies, replies):
        want = api.generate(pair, body["prompt"], max_tokens=24, temperature=0,
                            speculative=mode)
        if body["stream"]:
            pieces = [json.loads(line[6:]) for line in reply.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["text"] for p in pieces for c in p["choices"])
        else:
            answer = reply.json()
            text = answer["choices"][0]["text"]
            assert answer["choices"][0]["finish_reason"] == want.finish_reason
            assert answer["usage"]["completion_tokens"] == len(want.tokens)
        assert text == want.text


def _shape(chunk):
    return (chunk.text, chunk.reasoning, chunk.token, chunk.stop, chunk.thinking,
            chunk.finish_reason, chunk.finish_detail, chunk.stop_string, chunk.generation_tokens,
            chunk.stats.logprobs)


def test_each_rows_chunks_are_its_requests_chunks_alone(engine, pair):
    """Chunk for chunk: text, thinking, stop strings, finish reasons, counts, logprobs."""
    requests = [api.make_request(pair, "def read_config(path):", 40, temperature=0,
                                 stop=["path"], speculative="on"),
                api.make_request(pair, "<think>\n", 30, temperature=0, split_thinking=True),
                api.make_request(pair, "import os\n", 12, temperature=0, logprobs=2),
                api.make_request(pair, "class Stack:", 20, temperature=0.8, seed=7,
                                 speculative="on")]
    heard = []
    jobs = [_submit(engine, heard, r) for r in requests]
    _until(lambda: all(_over(heard, j) for j in jobs))
    for job, request in zip(jobs, requests):
        want = [_shape(c) for c in api.stream_generate(pair, request)]
        assert [_shape(c) for c in _events(heard, job)] == want
    assert _events(heard, jobs[0])[-1].stop_string == "path"
    assert _events(heard, jobs[2], "logprobs")


def test_a_short_request_finishes_while_a_long_prefill_is_still_running(engine, pair):
    heard = []
    long_request = api.make_request(pair, _long_prompt(1), 4, temperature=0)
    short_request = api.make_request(pair, "def f(x):", 3, temperature=0)
    long_job = _submit(engine, heard, long_request)
    _until(lambda: any(r["phase"] == "prefill" and r["done"] > 0
                       for r in engine.batch["rows"]))   # its first piece is in
    short_job = _submit(engine, heard, short_request)
    _until(lambda: _over(heard, long_job) and _over(heard, short_job))
    short_end = _index(heard, short_job, _final)
    assert short_end < _index(heard, long_job, lambda what, item: what == "chunk")
    assert _text(_events(heard, short_job)) == api.generate(pair, short_request).text
    assert _text(_events(heard, long_job)) == api.generate(pair, long_request).text


def test_a_client_leaving_mid_batch_leaves_the_other_rows_tokens_unchanged(engine, pair):
    heard, cancelled_before = [], engine.cancelled
    requests = [api.make_request(pair, p, 40, temperature=0, speculative="on")
                for p in PROMPTS[:3]]
    jobs = [_submit(engine, heard, r) for r in requests]
    leaving = jobs[1]
    _until(lambda: len(_events(heard, leaving)) >= 3)
    engine.cancel(leaving)                                  # its client goes away
    _until(lambda: all(_over(heard, j) for j in jobs))
    assert CANCELLED in _events(heard, leaving, "error")
    assert engine.cancelled == cancelled_before + 1
    # it left while the others still decoded, and their tokens are their tokens alone
    left = _index(heard, leaving, lambda what, item: what == "error")
    for job, request in zip(jobs, requests):
        if job is leaving:
            continue
        assert left < _index(heard, job, _final)
        tokens = [c.token for c in _events(heard, job) if not c.stop]
        assert tokens == api.generate(pair, request).tokens


def test_a_failing_batched_step_ends_its_rows_with_an_error_and_the_engine_serves_on(
        engine, pair, monkeypatch):
    heard, batch = [], engine.rows.batch
    step, calls = batch.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 3:                      # a few tokens in, the whole forward fails
            raise RuntimeError("the device went away")
        return step()
    monkeypatch.setattr(batch, "step", failing_once)
    requests = [api.make_request(pair, p, 40, temperature=0) for p in PROMPTS[:2]]
    jobs = [_submit(engine, heard, r) for r in requests]
    _until(lambda: all(_over(heard, j) for j in jobs))
    for job in jobs:
        assert _events(heard, job, "error") == ["generation failed: RuntimeError"]
    monkeypatch.undo()
    after = _submit(engine, heard, requests[0])             # the engine lives, rows reset
    _until(lambda: _over(heard, after))
    tokens = [c.token for c in _events(heard, after) if not c.stop]
    assert tokens == api.generate(pair, requests[0]).tokens


def test_a_row_decoding_beside_a_long_prefill_takes_the_budgets_steps_between_its_pieces(
        engine, pair):
    # counted in tokens, not seconds: the streaming row (serial, a token a turn) takes
    # piece / --prefill-budget turns between two of the long prompt's pieces (today: one)
    heard, rows = [], engine.rows
    talking = _submit(engine, heard, api.make_request(pair, PROMPTS[3], 1000, temperature=0,
                                                      speculative="off"))
    _until(lambda: len(_events(heard, talking)) >= 2)
    seen = []                           # after each turn: (long prompt's done, row's tokens)
    publish, budget = rows.publish, rows.prefill_budget

    def published():
        publish()
        reading = [m for m in rows.members if m is not talking]
        if reading:
            seen.append((reading[0].prefill["done"], len(_events(heard, talking))))
    rows.publish, rows.prefill_budget = published, 8
    try:
        reading = _submit(engine, heard, api.make_request(pair, _long_prompt(3), 8,
                                                          temperature=0))
        _until(lambda: _over(heard, reading))
    finally:
        rows.publish, rows.prefill_budget = publish, budget
    engine.cancel(talking)
    _until(lambda: _over(heard, talking))
    pieces_at = [i for i in range(1, len(seen)) if seen[i][0] > seen[i - 1][0]]
    assert len(pieces_at) == 4 and seen[pieces_at[-1]][0] == LONG
    for a, b in zip(pieces_at, pieces_at[1:]):      # the row's tokens, the piece's budget
        assert seen[b][1] - seen[a][1] >= (seen[b][0] - seen[a][0]) // 8 - 1
    assert [c.token for c in _events(heard, reading) if not c.stop] == \
        api.generate(pair, api.make_request(pair, _long_prompt(3), 8, temperature=0)).tokens


def test_health_shows_the_batch_and_each_rows_phase(engine, pair):
    client = app_client(engine, "demo")
    heard = []
    talking = _submit(engine, heard, api.make_request(pair, "import os\n", 200, temperature=0))
    _until(lambda: len(_events(heard, talking)) >= 2)
    reading = _submit(engine, heard, api.make_request(pair, _long_prompt(2), 2, temperature=0))
    seen = []

    def both():
        seen.append(client.get("/health").json())
        return {r["phase"] for r in seen[-1]["batch"]["rows"]} == {"prefill", "decode"}
    _until(both)
    health = seen[-1]
    assert health["batch"]["size"] == 2 and health["batch"]["max"] == 4
    assert health["waiting"] == 0 and health["status"] == "ok"     # the fields kept
    prefill = next(r for r in health["batch"]["rows"] if r["phase"] == "prefill")
    decode = next(r for r in health["batch"]["rows"] if r["phase"] == "decode")
    assert prefill["total"] == LONG and 0 <= prefill["done"] < LONG
    assert decode["generated"] >= 2
    assert prefill["route"] == decode["route"] == ""      # submitted here, not over HTTP
    engine.cancel(talking)
    _until(lambda: _over(heard, talking) and _over(heard, reading))
    _until(lambda: client.get("/health").json()["batch"]["size"] == 0)


THINK = [{"role": "user", "content": "Sort a list of numbers in Python."}]
AGENTS = [   # (route, body): a plain row, OpenAI's thinking budget, Anthropic's thinking
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}),
    ("/v1/chat/completions", {"messages": THINK, "max_tokens": 24, "temperature": 0,
                              "thinking_token_budget": 3, "logprobs": True, "top_logprobs": 2,
                              "chat_template_kwargs": {"enable_thinking": True}}),
    ("/v1/messages", {"messages": THINK, "max_tokens": 24, "temperature": 0,
                      "thinking": {"type": "adaptive"}, "output_config": {"effort": "minimal"}}),
    ("/v1/messages", {"messages": THINK, "max_tokens": 20, "temperature": 0, "stream": True,
                      "thinking": {"type": "enabled", "budget_tokens": 2}}),
]


def _answer(reply) -> object:
    """A reply without what differs between two sends (ids, times, the engine's stats)."""
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: {")]
        return [e.get("delta") or e.get("content_block") or e.get("usage") for e in events]
    body = reply.json()
    return {k: v for k, v in body.items() if k not in ("id", "created", "dspark")}


def test_thinking_budgets_openai_and_anthropic_decode_in_the_batch_beside_plain_rows_as_alone(
        engine, pair):
    app = create_app(engine, "demo")

    async def send(requests):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost",
                                     timeout=120) as http:
            return await asyncio.gather(*(http.post(route, json=body)
                                          for route, body in requests))
    decoding = []                       # after each turn: the budgets of the rows decoding
    rows, go = engine.rows, threading.Event()
    publish, advance, budget = rows.publish, rows.advance, rows.prefill_budget

    def published():
        publish()
        decoding.append(sorted(-1 if m.request.thinking_token_budget is None
                               else m.request.thinking_token_budget
                               for m in rows.members if m.row is not None))

    def gated():            # the first turn waits for every request: they join together
        go.wait()
        advance()

    def all_in():
        _until(lambda: len(rows.members) + engine.waiting == len(AGENTS))
        go.set()
    rows.publish, rows.advance, rows.prefill_budget = published, gated, 4 * 512
    watcher = threading.Thread(target=all_in)
    watcher.start()
    try:
        together = asyncio.run(send(AGENTS))
    finally:
        go.set()
        watcher.join()
        rows.publish, rows.advance, rows.prefill_budget = publish, advance, budget
    assert all(r.status_code == 200 for r in together)
    # the budgeted rows (OpenAI's 3, Anthropic's adaptive at "minimal", and its 2) stepped in
    # one batch beside the plain one
    assert [-1, 2, 3, 256] in decoding
    for (route, body), reply in zip(AGENTS, together):
        alone = asyncio.run(send([(route, body)]))[0]
        assert _answer(reply) == _answer(alone)
    chat = together[1].json()["choices"][0]
    assert chat["message"]["reasoning_content"] and chat["message"]["content"]
    assert len(chat["logprobs"]["content"]) == together[1].json()["usage"]["completion_tokens"]


def test_a_full_batch_and_queue_answer_busy(pair):
    for engine in started_engine(lambda: pair, max_queue=1, max_batch=2):
        heard = []
        jobs = [_submit(engine, heard, api.make_request(pair, p, 40, temperature=0))
                for p in PROMPTS[:3]]
        with pytest.raises(ApiError) as refused:
            _submit(engine, heard, api.make_request(pair, PROMPTS[3], 4, temperature=0))
        assert refused.value.status == 503
        _until(lambda: all(_over(heard, j) for j in jobs))


def test_rows_continue_from_the_prompt_cache_and_equal_cold_runs(pair):
    """Each row's snapshots (its prompt's end, its answer's end) hold its own state: the next
    turns, sent together, prefill only what is new and give what a cold run gives."""
    for engine in started_engine(lambda: pair, max_batch=4, cache_bytes=64 << 20):
        heard = []
        first = [api.make_request(pair, p, 12, temperature=0) for p in PROMPTS[:3]]
        jobs = [_submit(engine, heard, r) for r in first]
        _until(lambda: all(_over(heard, j) for j in jobs))
        answers = [[c.token for c in _events(heard, j) if not c.stop] for j in jobs]
        more = pair.tokenizer.encode(" again", add_special_tokens=False)
        second = [api.make_request(pair, list(r.prompt) + a + more, 12, temperature=0)
                  for r, a in zip(first, answers)]
        jobs = [_submit(engine, heard, r) for r in second]
        _until(lambda: all(_over(heard, j) for j in jobs))
        for job, request, answer, old in zip(jobs, second, answers, first):
            reused = _events(heard, job, "started")[0]
            assert reused == len(old.prompt) + len(answer) - 1   # all but the last answer token
            assert _text(_events(heard, job)) == api.generate(pair, request).text


def test_the_prefill_budget_is_a_number_of_tokens_above_zero(capsys):
    from mlx_dspark import cli
    from mlx_dspark.decode.pieces import PREFILL_BUDGET
    parse = cli.build_parser().parse_args
    assert parse(["serve"]).prefill_budget == PREFILL_BUDGET
    assert parse(["serve", "--prefill-budget", "0.5"]).prefill_budget == 0.5
    for bad in ("0", "-2", "nan", "inf", "many"):
        with pytest.raises(SystemExit):
            parse(["serve", "--prefill-budget", bad])
        assert "--prefill-budget" in capsys.readouterr().err
