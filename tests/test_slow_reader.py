"""A client that stops reading its stream (serve/job.py ``UNREAD``, issue 42): its job's queue
holds at most UNREAD events, the next is a ``slow_reader`` error that follows them, its
generation stops there, and the other rows of the batch, and the requests after it, are
served as alone. Demo pair, greedy, on a real event loop; a small bound for the test."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from mlx_dspark import api
from mlx_dspark.serve import job as job_module
from mlx_dspark.serve import relay
from mlx_dspark.serve.engine import Job
from mlx_dspark.serve.errors import ApiError

from testkit.server_helpers import served, started_engine, until

BOUND = 12
USER = [{"role": "user", "content": "class Stack:"}]


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.fixture(scope="module", params=[1, 2], ids=["alone", "batch"])
def engine(pair, request):
    yield from started_engine(lambda: pair, max_queue=4, max_batch=request.param)


async def _read_all(job: Job) -> list:
    """Every event of ``job`` until its last chunk or an error, read as they come."""
    out = []
    while True:
        kind, item = await job.take()
        out.append((kind, item))
        if kind == "error" or kind == "chunk" and item.finish_reason is not None:
            return out


def test_a_client_that_stops_reading_is_stopped_at_the_bound_and_the_others_go_on(
        engine, pair, monkeypatch):
    monkeypatch.setattr(job_module, "UNREAD", BOUND)
    slow_request = api.make_request(pair, "def read_config(path):", 200, temperature=0,
                                    speculative="off")
    fast_request = api.make_request(pair, "class Stack:", 40, temperature=0)
    served, cancelled = engine.served, engine.cancelled

    async def session():
        loop = asyncio.get_running_loop()
        slow, fast = Job(slow_request, loop), Job(fast_request, loop)
        engine.submit(slow)             # its client never reads
        engine.submit(fast)
        heard = await _read_all(fast)
        for _ in range(6000):           # the engine's thread has stopped the slow one
            if engine.cancelled > cancelled:
                break
            await asyncio.sleep(0.01)
        held = slow.out.qsize()
        unread = [event async for event in relay.events(engine, slow)]
        return heard, held, unread

    heard, held, unread = asyncio.run(session())
    assert held == BOUND + 1                    # the bound, and its error after it
    kinds = [kind for kind, _ in unread]
    assert kinds[0] == "started" and kinds[1:-1] == ["chunk"] * (BOUND - 1)
    error = unread[-1][1]
    assert kinds[-1] == "error" and isinstance(error, ApiError)
    assert error.code == "slow_reader" and f"{BOUND} events" in error.message
    tokens = [item.token for kind, item in heard if kind == "chunk" and not item.stop]
    assert tokens == api.generate(pair, fast_request).tokens    # as alone, all of them
    assert engine.served == served + 1 and engine.cancelled == cancelled + 1


@pytest.fixture
def url(engine):
    """The app served by uvicorn on a thread, on a free port."""
    with served(engine) as url:
        yield url


def _until(condition, seconds=300.0) -> bool:
    return until(condition, seconds)


def test_an_http_client_that_stops_reading_gets_the_error_after_what_was_queued(
        engine, pair, url, monkeypatch):
    """A real socket whose client reads nothing (a small receive buffer): once the sockets are
    full, the handler waits, BOUND more events queue, and the request is stopped; another
    client's stream meanwhile gets its whole answer. Reading at last, the client finds what
    was sent, then the slow_reader error, then ``[DONE]``. Before the bound, the engine went
    on generating all 20,000 tokens into the queue."""
    monkeypatch.setattr(job_module, "UNREAD", BOUND)
    cancelled = engine.cancelled
    eos = pair.tokenizer.eos_token_id
    body = json.dumps({"messages": [{"role": "user", "content": "def main():"}],
                       "max_tokens": 20_000, "temperature": 0, "stream": True,
                       "logit_bias": {str(eos): -100}}).encode()
    port = int(url.rsplit(":", 1)[1])
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body))
    with stalled:
        other = {"messages": USER, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120) as http, \
                http.stream("POST", url + "/v1/chat/completions", json=other) as r:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in r.iter_lines()
                           if line.startswith("data: {") and '"choices": [{' in line)
        assert text == api.generate(pair, USER, max_tokens=40, temperature=0).text
        assert _until(lambda: engine.cancelled > cancelled), "the stalled stream went on"
        received = b""
        while not received.endswith(b"0\r\n\r\n"):      # the chunked body's end
            received += stalled.recv(1 << 16)
    events = [line[6:].rstrip(b"\r") for line in received.split(b"\n")
              if line.startswith(b"data: ")]     # one SSE event per HTTP chunk
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "slow_reader"
    tokens = [e for e in events[:-2] if json.loads(e)["choices"][0]["delta"].get("content")]
    assert BOUND < len(tokens) < 20_000
