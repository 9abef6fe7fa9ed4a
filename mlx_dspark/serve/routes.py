"""The routes of ``mlx-dspark serve`` and what they share (:class:`Server`, the app's state).

A generating route reads its body into what it asks (its protocol's reader: an
:class:`~mlx_dspark.serve.asked.Asked`, the server's defaults merged in), queues it as one
:class:`~mlx_dspark.serve.engine.Job` (:meth:`Server.queue`: the prompt encoded, its message
ends found, its one Request built) and relays the reply (relay.py). Nothing after the
reader reads the body's options again."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .. import api
from ..grammar.limits import GrammarBusy
from ..request import RequestError
from ..text.tokenizer import chat_ids, message_boundaries, prompt_ids
from . import anthropic, errors, openai, relay, responses
from .asked import Asked, Defaults
from .engine import Engine, Job
from .errors import ApiError, ContextExceeded
from .fields import typed
from .openai import model_object, parse_body, text_chars

UNLIMITED = 1 << 31     # max_tokens of a chat request to a model that declares no limit
ENCODERS = 2            # prompts tokenized at once (each takes memory in proportion to its text)


class Server:
    """What every route shares: the engine (its pair's tokenizer and context limit), the
    names the model answers to (``model_ids``, the id first, then ``aliases`` for
    ``/v1/models``), the API key, the request :class:`Defaults` and the encoder slots."""

    def __init__(self, engine: Engine, model_ids: list[str], api_key: str | None,
                 defaults: Defaults, aliases=()):
        self.engine, self.model_ids, self.api_key = engine, model_ids, api_key
        self.model_id, self.aliases, self.defaults = model_ids[0], list(aliases), defaults
        self.tokenizer = engine.pair.tokenizer
        self.limit = engine.pair.target.context_limit
        self.vocab = engine.pair.target.config.vocab_size
        # No token decodes to more characters than the longest vocabulary entry, so a text
        # longer than limit * longest cannot fit the context: refused before it is tokenized.
        self.longest = max(map(len, self.tokenizer.get_vocab()), default=1) \
            if self.tokenizer is not None else 1
        self.encoders = asyncio.Semaphore(ENCODERS)
        # Header bytes as sent (HTTP headers are bytes; starlette reads them as latin-1), the
        # key as UTF-8: a non-ASCII key matches the client that sends it in UTF-8.
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    def authorize(self, request: Request):
        """The API key, when the server has one: Anthropic's ``x-api-key: KEY`` (or the
        Bearer header) on its routes, OpenAI's ``Authorization: Bearer KEY`` elsewhere."""
        if self.api_key is None:
            return
        if request.url.path.startswith(errors.ANTHROPIC_ROUTES):
            given = request.headers.get("x-api-key") or \
                request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode("latin-1"), self.api_key.encode()):
                raise ApiError("missing or wrong API key (send 'x-api-key: KEY')", status=401)
            return
        given = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, self.expected):
            raise ApiError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", status=401)

    async def queue(self, request: Request, asked: Asked, body: dict) -> Job:
        """``asked`` as the engine's job, queued: the prompt encoded, where its messages end
        (the prompt cache's checkpoints), its one Request built, whose snapshots it may use."""
        ids = await self.encode(asked)
        boundaries = await self.checkpoints(asked, ids)
        job = Job(await self.build(asked, ids), asyncio.get_running_loop(),
                  boundaries=boundaries, space=cache_space(request, body),
                  route=request.url.path)
        self.engine.submit(job)
        return job

    async def encode(self, asked: Asked) -> list[int]:
        """Token ids of a completion prompt (token ids as given), or of chat messages through
        the template (with the tools, then the reply's given start and a forced call's
        opening after the generation prompt)."""
        prompt, template = asked.prompt, asked.template
        if template is None and isinstance(prompt, list):
            return prompt
        where = "messages" if template is not None else "prompt"
        chars = len(prompt) if template is None else \
            text_chars(prompt, template, asked.use.tools, asked.prefill)
        if self.limit is not None and chars > self.limit * self.longest:
            raise ContextExceeded(f"the prompt has {chars} characters, more than this model's "
                                  f"context of {self.limit} tokens can hold", where,
                                  chars // self.longest, self.limit)
        try:
            async with self.encoders:
                if template is None:
                    ids = await run_in_threadpool(prompt_ids, self.tokenizer, prompt)
                else:
                    ids = await run_in_threadpool(chat_ids, self.tokenizer, prompt, template,
                                                  asked.use, asked.prefill)
        except RequestError as e:       # a media part that cannot be read, named
            raise ApiError(str(e), e.param) from None
        except Exception as e:   # no chat template, or the template refuses the messages
            raise ApiError(f"'{where}' cannot be encoded: "
                           f"{' '.join(str(e).split()) or type(e).__name__}", where) from None
        if not ids:
            raise ApiError(f"'{where}' encodes to no tokens", where)
        return ids

    async def checkpoints(self, asked: Asked, ids: list[int]) -> tuple:
        """Where chat messages end in ``ids``, for the prompt cache; in an encoder slot, as
        each end costs about what encoding the prompt did."""
        if self.engine.cache is None or asked.template is None:
            return ()
        use = asked.use
        options = {**asked.template, "tools": use.tools} if use.tools else asked.template
        async with self.encoders:
            return tuple(await run_in_threadpool(message_boundaries, self.tokenizer,
                                                 asked.prompt, options, ids))

    async def build(self, asked: Asked, ids: list[int]):
        """The Request, once the prompt fits the context (``max_tokens`` within what is left
        of it): ``asked.constraints()`` (the grammar keywords) and api.make_request, which
        compiles the grammar, run off the event loop (grammar_limits.compiled bounds the
        compilation itself)."""
        max_tokens = asked.options["max_tokens"]
        if self.limit is not None:
            if len(ids) >= self.limit:
                raise ContextExceeded(f"the prompt has {len(ids)} tokens; this model's context "
                                      f"limit is {self.limit}, leaving no room for an answer",
                                      asked.where, len(ids), self.limit)
            max_tokens = min(max_tokens or self.limit, self.limit - len(ids))
        options = dict(asked.options, max_tokens=max_tokens or UNLIMITED)

        def build():
            return api.make_request(self.engine.pair, ids, **options, **asked.constraints())
        try:
            return await run_in_threadpool(build)
        except RequestError as e:
            raise ApiError(str(e), e.param) from None
        except GrammarBusy as e:
            raise ApiError(str(e), status=503, type="server_error", code="server_busy") \
                from None


def cache_space(request: Request, body: dict) -> str:
    """Whose snapshots a request may continue from: those of requests with the same API key
    and the same ``cache_salt`` (vLLM's field), so a cached prefix is never shared across
    users (and ``cached_tokens`` tells nobody about another user's prompt)."""
    salt = typed(body, "cache_salt", (str,))
    if salt is not None and not salt:
        raise ApiError("'cache_salt' must be a non-empty string", "cache_salt")
    key = request.headers.get("x-api-key") or \
        request.headers.get("authorization", "").removeprefix("Bearer ")
    if not key and salt is None:
        return ""
    return hashlib.sha256(f"{key}\0{salt or ''}".encode()).hexdigest()


def _server(request: Request) -> Server:
    return request.app.state.server


async def _opened(request: Request) -> tuple[Server, dict]:
    """The app's server and the request's JSON body, once its API key passed."""
    server = _server(request)
    server.authorize(request)
    return server, parse_body(await request.body())


async def chat_completions(request: Request):
    """POST /v1/chat/completions."""
    return await _openai(request, "chat")


async def completions(request: Request):
    """POST /v1/completions."""
    return await _openai(request, "completion")


async def _openai(request: Request, kind: str):
    server, body = await _opened(request)
    asked = openai.read(body, kind, server.defaults, server.vocab)
    return await _answer(request, asked, body,
                         lambda name, job: openai.Reply(kind, name, asked.use),
                         functools.partial(relay.openai_stream,
                                           include_usage=asked.include_usage,
                                           tokenizer=server.tokenizer))


async def messages(request: Request):
    """POST /v1/messages (Anthropic): the same engine, Anthropic's shapes and errors."""
    server, body = await _opened(request)
    asked = anthropic.read(body, server.defaults)
    return await _answer(request, asked, body, lambda name, job: anthropic.MessageReply(
        name, asked.use, len(job.request.prompt)), relay.anthropic_stream)


async def count_tokens(request: Request):
    """POST /v1/messages/count_tokens (Anthropic): the prompt's exact token count."""
    server, body = await _opened(request)
    asked = anthropic.read(body, server.defaults, count=True)
    return JSONResponse({"input_tokens": len(await server.encode(asked))})


async def responses_(request: Request):
    """POST /v1/responses (OpenAI's Responses API, stateless)."""
    server, body = await _opened(request)
    asked = responses.read(body, server.defaults)
    return await _answer(request, asked, body, lambda name, job: responses.ResponseReply(
        name, asked, len(job.request.prompt)), relay.responses_stream)


async def _answer(request: Request, asked: Asked, body: dict, reply_of, stream_of):
    """Queue ``asked`` and answer: ``reply_of(name, job)``, the protocol's reply, whole, or
    streamed as ``stream_of(engine, job, reply)``'s events."""
    server = _server(request)
    job = await server.queue(request, asked, body)
    reply = reply_of(asked.model or server.model_id, job)
    if not asked.stream:
        return await relay.whole(request, server.engine, job, reply, server.tokenizer)
    return relay.streamed(stream_of(server.engine, job, reply))


async def models(request: Request):
    """The served model, under its id and each ``--alias``, in OpenAI's list shape with
    Anthropic's paging fields."""
    server = _server(request)
    server.authorize(request)
    names = list(dict.fromkeys([server.model_id, *server.aliases]))
    return JSONResponse({"object": "list",
                         "data": [model_object(n, server.limit) for n in names],
                         "has_more": False, "first_id": names[0], "last_id": names[-1]})


async def model(request: Request):
    """Any name: the served model answers to it (under its id, for the names it was started
    with)."""
    server = _server(request)
    server.authorize(request)
    name = request.path_params["name"]
    return JSONResponse(model_object(server.model_id if name in server.model_ids else name,
                                     server.limit))


async def root(request: Request):
    """``GET /`` and ``HEAD /``: the server is up (Claude Code probes its base URL with a
    ``HEAD /`` and took the 404 for a server that is not there). No key needed, as /health."""
    return JSONResponse({"status": "ok", "model": _server(request).model_id})


async def health(request: Request):
    server = _server(request)
    engine = server.engine
    return JSONResponse({"status": "ok", "model": server.model_id, "waiting": engine.waiting,
                         "served": engine.served, "cancelled": engine.cancelled,
                         "prefill": engine.prefill, "batch": engine.batch,
                         "prompt_cache": None if engine.cache is None else
                         engine.cache.health()})


ROUTES = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
          Route("/v1/completions", completions, methods=["POST"]),
          Route("/v1/messages", messages, methods=["POST"]),
          Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
          Route("/v1/responses", responses_, methods=["POST"]),
          Route("/v1/models", models, methods=["GET"]),
          Route("/v1/models/{name:path}", model, methods=["GET"]),
          Route("/health", health, methods=["GET"]),
          Route("/", root, methods=["GET", "HEAD"])]
