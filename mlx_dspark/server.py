"""``mlx-dspark serve``: an OpenAI-compatible HTTP server on the same engine (docs/serve.md).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when asked), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.

Handlers only parse (openai_api.py), tokenize, queue and relay: the :class:`Engine` thread
(engine.py) runs the generations, and a token reaches the client through an asyncio queue as
soon as it is generated."""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

# Imported here, on the main thread: mlx_lm imported first on another thread can abort the
# interpreter at exit ("terminate called without an active exception").
from . import api
from .engine import Engine, Job, log
from .openai_api import (COMPLETIONS_MAX_TOKENS, ApiError, Params, Reply, _get, _sse,
                         chat_messages, check_model, completion_prompt, error_response,
                         model_object, parse_body, sampling_options, stream_flags)
from .request import RequestError as RequestValueError
from .tokenizer import prompt_ids

UNLIMITED = 1 << 31     # max_tokens of a chat request to a model that declares no limit


async def _events(job: Job):
    """(kind, item) pairs of a job until its final chunk or an error; leaving early (the
    client went away) cancels the generation at its next token."""
    try:
        while True:
            kind, item = await job.out.get()
            yield kind, item
            if kind == "error" or item.finish_reason is not None:
                return
    finally:
        job.cancelled.set()


ENGINE_OPTIONS = ("num_draft", "speculative")     # set by the server, never by a request


def create_app(engine: Engine, model_id, api_key: str | None = None,
               defaults: dict | None = None) -> Starlette:
    """The ASGI app; ``engine`` must be started (its pair loaded). ``model_id``: the id it
    serves, or a list of the names it answers to (the id first). ``defaults``: the server's
    ``num_draft`` and ``speculative`` for every request, and the defaults of fields a request
    may leave out (``temperature``, ``top_p``, ``top_k``, ``max_tokens``,
    ``chat_template_kwargs``)."""
    model_ids = [model_id] if isinstance(model_id, str) else list(model_id)
    model_id = model_ids[0]
    defaults = dict(defaults or {})
    fixed = {k: defaults.pop(k) for k in ENGINE_OPTIONS if k in defaults}
    template_defaults = defaults.pop("chat_template_kwargs", None) or {}
    tokenizer = engine.pair.tokenizer
    limit = engine.pair.target.context_limit
    vocab = engine.pair.target.config.vocab_size

    def authorize(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key", status=401)

    async def read(request: Request, kind: str) -> Params:
        authorize(request)
        body = parse_body(await request.body())
        check_model(body, model_ids)
        stream, include_usage = stream_flags(body)
        if kind == "chat":
            where, prompt = "messages", chat_messages(body)
        else:
            where, prompt = "prompt", completion_prompt(body, vocab)
        options = sampling_options(body, COMPLETIONS_MAX_TOKENS if kind != "chat" else None,
                                   defaults)
        if kind != "chat" and isinstance(prompt, list):
            ids = prompt
        else:
            template = {**template_defaults, **(_get(body, "chat_template_kwargs", (dict,))
                                                or {})} if kind == "chat" else None
            try:
                ids = await run_in_threadpool(prompt_ids, tokenizer, prompt, kind == "chat",
                                              template)
            except Exception as e:   # no chat template, or the template refuses the messages
                raise ApiError(f"'{where}' cannot be encoded: "
                                   f"{' '.join(str(e).split()) or type(e).__name__}",
                                   where) from None
        if not ids:
            raise ApiError(f"'{where}' encodes to no tokens", where)
        if limit is not None:
            if len(ids) >= limit:
                raise ApiError(f"the prompt has {len(ids)} tokens; this model's context "
                                   f"limit is {limit}, leaving no room for an answer", where,
                                   "context_length_exceeded")
            options["max_tokens"] = min(options["max_tokens"] or limit, limit - len(ids))
        options["max_tokens"] = options["max_tokens"] or UNLIMITED
        try:
            req = api.make_request(engine.pair, ids, **options, **fixed)
        except RequestValueError as e:
            raise ApiError(str(e), e.param) from None
        return Params(req, stream, include_usage)

    async def complete(request: Request, kind: str):
        params = await read(request, kind)
        job = Job(params.request, asyncio.get_running_loop())
        engine.submit(job)
        reply = Reply(kind, model_id)
        if not params.stream:
            async for what, item in _events(job):
                if what == "error":
                    raise ApiError(item, status=500, type="server_error")
                reply.add(item)
            return JSONResponse(reply.whole())

        async def sse():
            first = True
            async for what, item in _events(job):
                if what == "error":
                    yield _sse({"error": {"message": item, "type": "server_error",
                                          "param": None, "code": None}})
                    break
                text = reply.add(item)
                if item.finish_reason is not None:      # the last token's chunk
                    if text or first:
                        yield _sse(reply.piece(text, first))
                    end = reply.piece("", finish=reply.finish_reason)
                    yield _sse({**end, "dspark": reply.stats.as_dict()})
                    if params.include_usage:
                        yield _sse(reply.usage_piece())
                elif text:
                    yield _sse(reply.piece(text, first))
                    first = False
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def chat_completions(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "completion")

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_object(model_id)]})

    async def model(request: Request):
        authorize(request)
        name = request.path_params["name"]
        if name not in model_ids:
            raise ApiError(f"model '{name}' is not served here; this server serves "
                           f"'{model_id}'", "model", "model_not_found", status=404)
        return JSONResponse(model_object(model_id))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, "waiting": engine.waiting,
                             "served": engine.served, "cancelled": engine.cancelled,
                             "prefix_cache": None if engine.cache is None else
                             {"snapshots": len(engine.cache), "bytes": engine.cache.nbytes,
                              "budget_bytes": engine.cache.budget}})

    async def refused(request: Request, e: ApiError):
        return error_response(e)

    async def http_error(request: Request, e: HTTPException):
        return error_response(ApiError(
            f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
            code="not_found" if e.status_code == 404 else None))

    async def crashed(request: Request, e: Exception):
        log.exception("request failed")
        return error_response(ApiError(f"internal error ({type(e).__name__})",
                                           status=500, type="server_error"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()       # at shutdown, before uvicorn hands a Ctrl-C or SIGTERM back

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: refused, HTTPException: http_error, Exception: crashed})


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
          defaults: dict | None = None):
    """Run on the bound ``sock`` (:func:`listen`) until Ctrl-C or SIGTERM: the generation in
    flight stops at its next token, every open request ends with an error event, uvicorn
    closes the connections and the engine thread ends."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.cancel_all("the server is shutting down")
            super().handle_exit(sig, frame)

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(engine, model_id, api_key, defaults), host=host, port=port,
                            log_level="info", timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])
