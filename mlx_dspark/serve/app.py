"""``mlx-dspark serve``: an OpenAI- and Anthropic-compatible HTTP server on the same engine
(docs/serve.md).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when asked), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic),
``POST /v1/responses`` (OpenAI's Responses API), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``.

Here: the app (its routes are routes.py's, with their shared state), the socket and the
uvicorn server around it. Routes only read (openai.py, anthropic.py, responses.py), tokenize,
queue and relay (relay.py): the :class:`Engine` thread (engine.py) runs the generations, and
a token reaches the client through an asyncio queue as soon as it is generated."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request

from .. import open_files
# routes imports the API (and mlx_lm) here, on the main thread: mlx_lm imported first on
# another thread can abort the interpreter at exit ("terminate called without an active
# exception").
from . import errors, routes
from .asked import Defaults
from .connections import Limits
from .engine import Engine, log
from .errors import ApiError
from .http_guard import Exposure, HttpGuard

FILES_RESERVED = 64     # descriptors kept for files the process opens later (snapshots, logs)
ACCEPT_BATCH = 64       # connections asyncio accepts in one go, before any of them is seen


def create_app(engine: Engine, model_id, api_key: str | None = None,
               defaults: dict | None = None, exposure: Exposure | None = None,
               aliases=()) -> Starlette:
    """The ASGI app; ``engine`` must be started (its pair loaded). ``model_id``: the id it
    serves, or a list of its names (the id first); any model name a request gives is
    answered by it, and the reply carries that name. ``aliases``: more names ``/v1/models``
    lists (``serve --alias``). ``defaults``: the server's ``num_draft`` and ``speculative``
    for every request, and the defaults of fields a request may leave out
    (``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``chat_template_kwargs``), read
    once into a :class:`~mlx_dspark.serve.asked.Defaults`. ``exposure``: who may reach it
    (serve/http_guard.py; default: this machine, no web origin)."""
    if api_key is not None and not api_key:
        raise ValueError("an empty API key would let no request in")
    model_ids = [model_id] if isinstance(model_id, str) else list(model_id)
    app = Starlette(routes=routes.ROUTES, lifespan=_lifespan,
                    middleware=[Middleware(HttpGuard, exposure=exposure or Exposure())],
                    exception_handlers={ApiError: _refused, HTTPException: _http_error,
                                        Exception: _crashed})
    app.state.server = routes.Server(engine, model_ids, api_key, Defaults.of(defaults),
                                     aliases)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    yield
    app.state.server.engine.stop()   # at shutdown, before uvicorn hands a Ctrl-C or SIGTERM back


async def _refused(request: Request, e: ApiError):
    return errors.response(e, request.url.path)


async def _http_error(request: Request, e: HTTPException):
    return errors.response(ApiError(
        f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
        code="not_found" if e.status_code == 404 else None), request.url.path)


async def _crashed(request: Request, e: Exception):
    log.exception("request failed")
    return errors.response(ApiError(f"internal error ({type(e).__name__})", status=500,
                                    type="server_error"), request.url.path)


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


def _log_config(uvicorn_config: dict) -> dict:
    """uvicorn's logging, and the server's own logger (``mlx_dspark.serve``: prefill progress,
    warnings) on its handler at INFO."""
    config = copy.deepcopy(uvicorn_config)
    config["loggers"]["mlx_dspark"] = {"handlers": ["default"], "level": "INFO",
                                       "propagate": False}
    return config


def serve(engine: Engine, model_id, sock, api_key: str | None,
          defaults: dict | None = None, exposure: Exposure | None = None,
          limits: Limits | None = None, aliases=()):
    """Run on the bound ``sock`` (:func:`listen`) until Ctrl-C or SIGTERM: the generation in
    flight stops at its next token (or its prefill's next piece), every open request ends
    with an error event, uvicorn closes the connections and the engine thread ends. The
    server's own log lines (prefill progress, warnings) go out as uvicorn's do."""
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
                            log_config=_log_config(uvicorn.config.LOGGING_CONFIG),
                            timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])
