"""``mlx-dspark serve``: an OpenAI- and Anthropic-compatible HTTP server on the same engine
(docs/serve.md).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when asked), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic),
``POST /v1/responses`` (OpenAI's Responses API), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``.

Handlers only parse (openai.py, anthropic.py), tokenize, queue and relay: the :class:`Engine` thread
(engine.py) runs the generations, and a token reaches the client through an asyncio queue as
soon as it is generated."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

# Imported here, on the main thread: mlx_lm imported first on another thread can abort the
# interpreter at exit ("terminate called without an active exception").
from .. import api, open_files
from ..decode.grammar_limits import GrammarBusy
from ..request import RequestError as RequestValueError
from ..text.tokenizer import chat_ids, message_boundaries, prompt_ids
from . import anthropic, errors, fields, logprobs, responses
from .answer import one_call_stops
from .connections import Limits
from .engine import Engine, Job, log
from .http_guard import Exposure, HttpGuard
from .errors import ApiError, ContextExceeded
from .openai import (COMPLETIONS_MAX_TOKENS, Params, Reply, ToolUse, _sse, chat_messages,
                     check_model, completion_prompt, constraint_options, logprobs_request,
                     parse_body, sampling_options, stream_flags, text_chars, thinking_options,
                     tool_use, _get, model_object)

UNLIMITED = 1 << 31     # max_tokens of a chat request to a model that declares no limit
FILES_RESERVED = 64     # descriptors kept for files the process opens later (snapshots, logs)
ACCEPT_BATCH = 64       # connections asyncio accepts in one go, before any of them is seen
ENCODERS = 2            # prompts tokenized at once (each takes memory in proportion to its text)
KEEPALIVE_SECONDS = 10.0    # the longest silence on a stream (queued, or a long prefill)


async def _events(engine: Engine, job: Job, keepalive: bool = False):
    """(kind, item) pairs of a job until its final chunk or an error (``("started",
    reused)`` first, when it leaves the queue); with ``keepalive``, a
    ``("keepalive", position)`` after each KEEPALIVE_SECONDS without one (``position`` in
    the queue, None once running). Leaving early (the client went away) cancels the job: a
    waiting one leaves the queue at once, a running one stops at its next token."""
    try:
        while True:
            try:
                kind, item = await asyncio.wait_for(
                    job.out.get(), KEEPALIVE_SECONDS if keepalive else None)
            except asyncio.TimeoutError:
                kind, item = "keepalive", engine.position(job)
            yield kind, item
            if kind == "error" or kind == "chunk" and item.finish_reason is not None:
                return
    finally:
        engine.cancel(job)


ENGINE_OPTIONS = ("num_draft", "speculative")     # set by the server, never by a request


@contextlib.asynccontextmanager
async def _cancelled_on_disconnect(request: Request, engine: Engine, job: Job):
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


def create_app(engine: Engine, model_id, api_key: str | None = None,
               defaults: dict | None = None, exposure: Exposure | None = None,
               aliases=()) -> Starlette:
    """The ASGI app; ``engine`` must be started (its pair loaded). ``model_id``: the id it
    serves, or a list of its names (the id first); any model name a request gives is
    answered by it, and the reply carries that name. ``aliases``: more names ``/v1/models``
    lists (``serve --alias``). ``defaults``: the server's
    ``num_draft`` and ``speculative`` for every request, and the defaults of fields a request
    may leave out (``temperature``, ``top_p``, ``top_k``, ``max_tokens``,
    ``chat_template_kwargs``). ``exposure``: who may reach it (serve/http_guard.py; default: this
    machine, no web origin)."""
    if api_key is not None and not api_key:
        raise ValueError("an empty API key would let no request in")
    model_ids = [model_id] if isinstance(model_id, str) else list(model_id)
    model_id = model_ids[0]
    defaults = dict(defaults or {})
    fixed = {k: defaults.pop(k) for k in ENGINE_OPTIONS if k in defaults}
    template_defaults = defaults.pop("chat_template_kwargs", None) or {}
    tokenizer = engine.pair.tokenizer
    limit = engine.pair.target.context_limit
    vocab = engine.pair.target.config.vocab_size
    # No token decodes to more characters than the longest vocabulary entry, so a text longer
    # than limit * longest cannot fit the context: refused before it is tokenized.
    longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
    encoders = asyncio.Semaphore(ENCODERS)
    # Header bytes as sent (HTTP headers are bytes; starlette reads them as latin-1), the key
    # as UTF-8: a non-ASCII key matches the client that sends it in UTF-8.
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    def authorize(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, expected):
            raise ApiError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key", status=401)

    async def read(request: Request, kind: str) -> Params:
        authorize(request)
        body = parse_body(await request.body())
        fields.check(body, kind)
        name = check_model(body, model_ids)
        stream, include_usage = stream_flags(body)
        options = sampling_options(body, COMPLETIONS_MAX_TOKENS if kind != "chat" else None,
                                   defaults)
        options["logprobs"] = logprobs_request(body, kind)
        use, budget, boundaries = ToolUse(), None, ()
        if kind == "chat":
            messages, use = chat_messages(body), tool_use(body)
            template, budget = thinking_options(body, template_defaults)
            ids = await encode(messages, template, use)
            boundaries = await checkpoints(messages, template, use, ids)
            options["stop"] = options["stop"] + one_call_stops(use)
        else:
            prompt = completion_prompt(body, vocab)
            ids = prompt if isinstance(prompt, list) else await encode(prompt)
        generation = await make_request(ids, options, budget, "messages" if kind == "chat"
                                        else "prompt", lambda: constraint_options(body, use))
        if kind != "chat":
            # a completion is the model's text as written, its thinking and closing tag
            # included: the completions shape has no other place for them
            generation = dataclasses.replace(generation, thinking=None)
        params = Params(generation, stream, include_usage, use)
        return params, boundaries, cache_space(request, body), name

    async def encode(prompt, template=None, use: ToolUse | None = None,
                     prefill: str = "") -> list[int]:
        """Token ids of a completion prompt, or of chat messages through the template (with
        the tools, then the reply's given start and a forced call's opening after the
        generation prompt)."""
        where = "messages" if template is not None else "prompt"
        chars = len(prompt) if isinstance(prompt, str) else \
            text_chars(prompt, template, use.tools, prefill)
        if limit is not None and chars > limit * longest:
            raise ContextExceeded(f"the prompt has {chars} characters, more than this model's "
                                  f"context of {limit} tokens can hold", where,
                                  chars // longest, limit)
        try:
            async with encoders:
                if template is None:
                    ids = await run_in_threadpool(prompt_ids, tokenizer, prompt)
                else:
                    ids = await run_in_threadpool(chat_ids, tokenizer, prompt, template, use,
                                                  prefill)
        except Exception as e:   # no chat template, or the template refuses the messages
            raise ApiError(f"'{where}' cannot be encoded: "
                           f"{' '.join(str(e).split()) or type(e).__name__}", where) from None
        if not ids:
            raise ApiError(f"'{where}' encodes to no tokens", where)
        return ids

    async def checkpoints(messages, template: dict, use: ToolUse, ids: list[int]) -> tuple:
        """Where the messages end in ``ids``, for the prompt cache; in an encoder slot, as
        each end costs about what encoding the prompt did."""
        if engine.cache is None:
            return ()
        options = {**template, "tools": use.tools} if use.tools else template
        async with encoders:
            return tuple(await run_in_threadpool(message_boundaries, tokenizer, messages,
                                                 options, ids))

    async def make_request(ids: list[int], options: dict, budget: int | None, where: str,
                           constraints=dict):
        """The Request, once the prompt fits the context: ``constraints()`` (the grammar
        keywords) and api.make_request, which compiles the grammar, run off the event loop
        (grammar_limits.compiled bounds the compilation itself)."""
        if limit is not None:
            if len(ids) >= limit:
                raise ContextExceeded(f"the prompt has {len(ids)} tokens; this model's context "
                                      f"limit is {limit}, leaving no room for an answer", where,
                                      len(ids), limit)
            options["max_tokens"] = min(options["max_tokens"] or limit, limit - len(ids))
        options["max_tokens"] = options["max_tokens"] or UNLIMITED

        def build():
            return api.make_request(engine.pair, ids, **options, **constraints(), **fixed,
                                    thinking_token_budget=budget)
        try:
            return await run_in_threadpool(build)
        except RequestValueError as e:
            raise ApiError(str(e), e.param) from None
        except GrammarBusy as e:
            raise ApiError(str(e), status=503, type="server_error", code="server_busy") \
                from None

    async def complete(request: Request, kind: str):
        params, boundaries, space, name = await read(request, kind)
        job = Job(params.request, asyncio.get_running_loop(), boundaries=boundaries,
                  space=space)
        engine.submit(job)
        reply = Reply(kind, name, params.tools)
        if not params.stream:
            async with _cancelled_on_disconnect(request, engine, job):
                async for what, item in _events(engine, job):
                    if what == "started":
                        continue
                    if what == "error":
                        raise ApiError.of_failure(item)
                    if what == "logprobs":
                        reply.logprobs = logprobs.openai(kind, item, tokenizer)
                    else:
                        reply.add(item)
            return JSONResponse(reply.whole())

        async def sse():
            first = True      # the role piece goes out with the first token, not before
            async for what, item in _events(engine, job, keepalive=True):
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
                    reply.logprobs = logprobs.openai(kind, item, tokenizer)
                    continue
                for piece in reply.pieces(reply.add(item)):
                    yield _sse(piece)
                if item.finish_reason is not None:      # the last token's chunk
                    yield _sse(reply.end_piece())
                    if params.include_usage:
                        yield _sse(reply.usage_piece())
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def anthropic_key(request: Request):
        if api_key is not None:
            given = request.headers.get("x-api-key") or \
                request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode("latin-1"), api_key.encode()):
                raise ApiError("missing or wrong API key (send 'x-api-key: KEY')", status=401)

    async def messages(request: Request):
        """POST /v1/messages (Anthropic): the same engine, Anthropic's shapes and errors."""
        try:
            anthropic_key(request)
            body = parse_body(await request.body())
            name = check_model(body, model_ids)
            m = anthropic.read(body)
            ids = await encode(m.messages, m.template, m.use, m.prefill)
            options = dict(m.options, stop=m.options["stop"] + one_call_stops(m.use))
            params = await make_request(ids, options, m.budget, "messages",
                                        lambda: constraint_options({}, m.use))  # forced calls
            stream = bool(_get(body, "stream", (bool,)))
            job = Job(params, asyncio.get_running_loop(), space=cache_space(request, {}),
                      boundaries=await checkpoints(m.messages, m.template, m.use, ids))
            engine.submit(job)
        except ApiError as e:
            return errors.response(e, request.url.path)
        reply = anthropic.MessageReply(name, m.use, len(ids))
        if not stream:
            async with _cancelled_on_disconnect(request, engine, job):
                async for what, item in _events(engine, job):
                    if what == "error":
                        return errors.response(ApiError.of_failure(item), request.url.path)
                    if what == "chunk":
                        reply.add(item)
            return JSONResponse(reply.whole())

        async def events():
            started = False     # message_start: once the prefix is restored (its usage then
            async for what, item in _events(engine, job, keepalive=True):   # known), or at
                if not started and what != "error":                          # the first ping
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

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def count_tokens(request: Request):
        """POST /v1/messages/count_tokens (Anthropic): the prompt's exact token count."""
        try:
            anthropic_key(request)
            m = anthropic.read(parse_body(await request.body()), count=True)
            ids = await encode(m.messages, m.template, m.use, m.prefill)
        except ApiError as e:
            return errors.response(e, request.url.path)
        return JSONResponse({"input_tokens": len(ids)})

    async def responses_(request: Request):
        """POST /v1/responses (OpenAI's Responses API, stateless)."""
        authorize(request)
        body = parse_body(await request.body())
        name = check_model(body, model_ids)
        r = responses.read(body, defaults, template_defaults)
        ids = await encode(r.messages, r.template, r.use)
        r.options["stop"] = r.options["stop"] + one_call_stops(r.use)
        job = Job(await make_request(ids, r.options, r.budget, "input", r.constraints),
                  asyncio.get_running_loop(), space=cache_space(request, body),
                  boundaries=await checkpoints(r.messages, r.template, r.use, ids))
        engine.submit(job)
        reply = responses.ResponseReply(name, r, len(ids))
        if not r.stream:
            async with _cancelled_on_disconnect(request, engine, job):
                async for what, item in _events(engine, job):
                    if what == "error":
                        raise ApiError.of_failure(item)
                    if what == "chunk":
                        reply.add(item)
            return JSONResponse(reply.whole())

        async def events():
            for event in reply.start():
                yield anthropic.sse(event["type"], event)
            async for what, item in _events(engine, job, keepalive=True):
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

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def chat_completions(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "completion")

    async def models(request: Request):
        """The served model, under its id and each ``--alias``, in OpenAI's list shape with
        Anthropic's paging fields."""
        authorize(request)
        names = list(dict.fromkeys([model_id, *aliases]))
        return JSONResponse({"object": "list", "data": [model_object(n) for n in names],
                             "has_more": False, "first_id": names[0], "last_id": names[-1]})

    async def model(request: Request):
        """Any name: the served model answers to it (under its id, for the names it was
        started with)."""
        authorize(request)
        name = request.path_params["name"]
        return JSONResponse(model_object(model_id if name in model_ids else name))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, "waiting": engine.waiting,
                             "served": engine.served, "cancelled": engine.cancelled,
                             "prompt_cache": None if engine.cache is None else
                             engine.cache.health()})

    async def refused(request: Request, e: ApiError):
        return errors.response(e, request.url.path)

    async def http_error(request: Request, e: HTTPException):
        return errors.response(ApiError(
            f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
            code="not_found" if e.status_code == 404 else None), request.url.path)

    async def crashed(request: Request, e: Exception):
        log.exception("request failed")
        return errors.response(ApiError(f"internal error ({type(e).__name__})", status=500,
                                        type="server_error"), request.url.path)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/messages", messages, methods=["POST"]),
              Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
              Route("/v1/responses", responses_, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()       # at shutdown, before uvicorn hands a Ctrl-C or SIGTERM back

    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(HttpGuard, exposure=exposure or Exposure())],
                     exception_handlers={ApiError: refused, HTTPException: http_error,
                                         Exception: crashed})


def keepalive_comment(position: int | None) -> str:
    """An SSE comment (clients skip it) that keeps a waiting OpenAI stream alive."""
    return f": queued, position {position}\n\n" if position else ": running\n\n"


def cache_space(request: Request, body: dict) -> str:
    """Whose snapshots a request may continue from: those of requests with the same API key
    and the same ``cache_salt`` (vLLM's field), so a cached prefix is never shared across
    users (and ``cached_tokens`` tells nobody about another user's prompt)."""
    salt = _get(body, "cache_salt", (str,))
    if salt is not None and not salt:
        raise ApiError("'cache_salt' must be a non-empty string", "cache_salt")
    key = request.headers.get("x-api-key") or \
        request.headers.get("authorization", "").removeprefix("Bearer ")
    if not key and salt is None:
        return ""
    return hashlib.sha256(f"{key}\0{salt or ''}".encode()).hexdigest()


def listen(host: str, port: int):
    """The server's socket, bound before the model loads, so a busy port costs no loading
    time; OSError when it cannot be had."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve(engine: Engine, model_id, sock, api_key: str | None,
          defaults: dict | None = None, exposure: Exposure | None = None,
          limits: Limits | None = None, aliases=()):
    """Run on the bound ``sock`` (:func:`listen`) until Ctrl-C or SIGTERM: the generation in
    flight stops at its next token, every open request ends with an error event, uvicorn
    closes the connections and the engine thread ends."""
    import uvicorn

    from .connections import out_of_files_handler, protocol

    limits = limits or Limits()
    # Descriptors for every connection, plus those the process holds already and a batch of
    # accepts in flight, as far as the hard limit allows; fewer connections when it allows less.
    reserve = open_files.in_use() + ACCEPT_BATCH + FILES_RESERVED
    room = open_files.raise_limit(limits.max_connections + reserve) - reserve
    if room < limits.max_connections:
        log.warning("the open-file limit allows %d connections, not %d", room,
                    limits.max_connections)
        limits = dataclasses.replace(limits, max_connections=max(room, 1))
    guarded = protocol(limits)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.cancel_all("the server is shutting down")
            super().handle_exit(sig, frame)

        async def serve(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(
                out_of_files_handler(guarded, ACCEPT_BATCH))
            await super().serve(sockets)

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(engine, model_id, api_key, defaults, exposure, aliases),
                            host=host, port=port, http=guarded,
                            limit_concurrency=limits.max_connections + 1,
                            # asyncio accepts up to a backlog of connections before any of
                            # them is seen: within the reserve, so accepting never hits the
                            # open-file limit before the oldest slow ones are closed
                            backlog=ACCEPT_BATCH,
                            timeout_keep_alive=limits.idle_timeout, log_level="info",
                            timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])
