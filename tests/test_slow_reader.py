"""A client that stops reading its stream (serve/job.py ``UNREAD``, issue 42): its job's queue
holds at most UNREAD events, the next is a ``slow_reader`` error that follows them, its
generation stops there, and the other rows of the batch, and the requests after it, are
served as alone. Demo pair, greedy, on a real event loop; a small bound for the test."""

from __future__ import annotations

import asyncio

import pytest

from mlx_dspark import api
from mlx_dspark.serve import job as job_module
from mlx_dspark.serve import relay
from mlx_dspark.serve.engine import Job
from mlx_dspark.serve.errors import ApiError

from server_helpers import started_engine

BOUND = 12


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
