"""From a queued job back to its client: the engine's events (with keep-alives while it
waits in the queue or prefills), a client that leaves cancelling its job, and each protocol's
reply, whole or streamed as server-sent events (the shapes are openai.py's, anthropic.py's
and responses.py's)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from . import anthropic, errors, logprobs
from .engine import Engine, Job
from .errors import ApiError
from .openai import Reply, _sse

KEEPALIVE_SECONDS = 10.0    # the longest silence on a stream (queued, or a long prefill)


async def events(engine: Engine, job: Job, keepalive: bool = False):
    """(kind, item) pairs of a job until its final chunk or an error (``("started",
    reused)`` first, when it leaves the queue); with ``keepalive``, a
    ``("keepalive", position)`` after each KEEPALIVE_SECONDS without one (``position`` in
    the queue, None once running). Leaving early (the client went away) cancels the job: a
    waiting one leaves the queue at once, a running one stops at its next token (or its
    prefill's next piece)."""
    try:
        while True:
            try:
                kind, item = await job.take(KEEPALIVE_SECONDS if keepalive else None)
            except asyncio.TimeoutError:
                kind, item = "keepalive", engine.position(job)
            yield kind, item
            if kind == "error" or kind == "chunk" and item.finish_reason is not None:
                return
    finally:
        engine.cancel(job)


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(request: Request, engine: Engine, job: Job):
    """While in the block, a client that goes away (for a non-streamed answer) cancels the
    job: its body is read, so the next message it sends is the disconnect."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(job)

    watching = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watching.cancel()


async def whole(request: Request, engine: Engine, job: Job, reply, tokenizer) -> JSONResponse:
    """A non-streamed answer: every chunk into ``reply`` (any of the three protocols'), then
    its whole object; a failed generation is the route's error. Log-probabilities come only
    to the OpenAI routes (the only ones whose requests ask for them)."""
    async with cancelled_on_disconnect(request, engine, job):
        async for what, item in events(engine, job):
            if what == "error":
                raise ApiError.of_failure(item)
            if what == "chunk":
                reply.add(item)
            elif what == "logprobs":
                reply.logprobs = logprobs.openai(reply.kind, item, tokenizer)
    return JSONResponse(reply.whole())


def streamed(pieces) -> StreamingResponse:
    """Server-sent events as they come."""
    return StreamingResponse(pieces, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def keepalive_comment(position: int | None) -> str:
    """An SSE comment (clients skip it) that keeps a waiting OpenAI stream alive."""
    return f": queued, position {position}\n\n" if position else ": running\n\n"


async def openai_stream(engine: Engine, job: Job, reply: Reply, include_usage: bool,
                        tokenizer):
    """A chat completion's or a completion's pieces, then ``[DONE]``."""
    first = True      # the role piece goes out with the first token, not before
    async for what, item in events(engine, job, keepalive=True):
        if what == "keepalive":     # an SSE comment, which clients skip
            yield keepalive_comment(item)
            continue
        if what == "started":
            continue
        if first and what == "chunk":
            yield _sse(reply.first_piece())
            first = False
        if what == "error":
            yield _sse(errors.openai_body(ApiError.of_failure(item)))
            break
        if what == "logprobs":
            reply.logprobs = logprobs.openai(reply.kind, item, tokenizer)
            continue
        for piece in reply.pieces(reply.add(item)):
            yield _sse(piece)
        if item.finish_reason is not None:      # the last token's chunk
            yield _sse(reply.end_piece())
            if include_usage:
                yield _sse(reply.usage_piece())
    yield "data: [DONE]\n\n"


async def anthropic_stream(engine: Engine, job: Job, reply: anthropic.MessageReply):
    """A message's events: ``message_start`` once the prefix is restored (its usage then
    known) or at the first ping, then its blocks, ``message_stop`` last."""
    started = False
    async for what, item in events(engine, job, keepalive=True):
        if not started and what != "error":
            reply.reused = item if what == "started" else 0
            started = True
            for event, data in reply.start():
                yield anthropic.sse(event, data)
        if what == "started":
            continue
        if what == "keepalive":
            yield anthropic.sse("ping", anthropic.ping(item))
            continue
        if what == "error":
            yield anthropic.sse("error", errors.anthropic_body(ApiError.of_failure(item)))
            return
        for event, data in reply.events(reply.add(item)):
            yield anthropic.sse(event, data)
        if item.finish_reason is not None:
            for event, data in reply.end():
                yield anthropic.sse(event, data)


async def responses_stream(engine: Engine, job: Job, reply):
    """A response's ``response.*`` events (``reply``: a responses.ResponseReply)."""
    for event in reply.start():
        yield anthropic.sse(event["type"], event)
    async for what, item in events(engine, job, keepalive=True):
        if what == "keepalive":
            yield keepalive_comment(item)
        elif what == "error":
            yield anthropic.sse("response.failed",
                                reply.failed(ApiError.of_failure(item).message))
            return
        elif what == "chunk":
            for event in reply.events(reply.add(item)) + \
                    (reply.end() if item.finish_reason is not None else []):
                yield anthropic.sse(event["type"], event)
