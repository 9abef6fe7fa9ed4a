"""``mlx-dspark serve``: an OpenAI-compatible HTTP server on the same engine (docs/serve.md).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when asked), ``GET /v1/models``, ``GET /health``.

One :class:`Engine` thread owns the pair and runs one generation at a time, first come first
served. A pair has one target cache and one drafter context, and MLX runs one stream of work;
serving requests in turn keeps each generation exactly what ``generate()`` gives (batching
several sequences into one forward is a later step). Every MLX call happens on that thread,
loading included, so no lazy array crosses threads. Handlers only parse, tokenize, queue and
relay: a token reaches the client through an asyncio queue as soon as it is generated.

Between requests the engine keeps session snapshots in a :class:`PrefixCache`, so a chat
whose next turn resends the conversation prefills only the new tokens."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

# Imported here, on the main thread: mlx_lm imported first on another thread can abort the
# interpreter at exit ("terminate called without an active exception").
from . import api
from .prefix_cache import PrefixCache
from .tokenizer import encode

log = logging.getLogger("mlx_dspark.serve")

COMPLETIONS_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat runs to the limit
MAX_STOPS = 4                   # as OpenAI


class RequestError(Exception):
    """A request the server refuses: HTTP status and an OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = \
            message, param, code, status, type


def error_response(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param,
                                   "code": e.code}}, status_code=e.status, headers=headers)


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Params:
    """What a request asks for, checked."""

    prompt: list[int]
    options: dict               # stream_generate keyword arguments
    stream: bool
    include_usage: bool


def _get(body: dict, name: str, kinds, check=None, what: str = ""):
    """``body[name]`` if present and not null, of one of ``kinds`` (bools are not numbers)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = {int: "an integer", str: "a string", bool: "a boolean", list: "an array",
                 dict: "an object"}
        want = "a number" if float in kinds else " or ".join(names[k] for k in kinds)
        raise RequestError(f"'{name}' must be {want}, not {json.dumps(value)[:40]}", name)
    if check is not None and not check(value):
        raise RequestError(f"'{name}' must be {what}, not {value}", name)
    return value


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def sampling_options(body: dict, default_max_tokens: int | None) -> dict:
    """stream_generate keyword arguments from the OpenAI sampling fields."""
    num = (int, float)
    temperature = _get(body, "temperature", num, lambda t: 0 <= t <= 2 and math.isfinite(t),
                       "between 0 and 2")
    top_p = _get(body, "top_p", num, lambda p: 0 < p <= 1, "in (0, 1]")
    top_k = _get(body, "top_k", (int,), lambda k: k >= 0, "0 (off) or more")
    seed = _get(body, "seed", (int,), lambda s: 0 <= s < 2**64, "in [0, 2**64)")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        max_tokens = _get(body, name, (int,), lambda n: n >= 1, "at least 1")
        if max_tokens is not None:
            break
    stop = _get(body, "stop", (str, list))
    stop = [stop] if isinstance(stop, str) else stop or []
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} non-empty strings", "stop")
    n = _get(body, "n", (int,))
    if n not in (None, 1):
        raise RequestError("'n' must be 1: this server returns one choice per request", "n")
    return dict(max_tokens=max_tokens or default_max_tokens,
                temperature=float(temperature) if temperature is not None else 1.0,
                top_p=float(top_p) if top_p is not None else 1.0, top_k=top_k or 0, seed=seed,
                stop=stop)


def chat_messages(body: dict) -> list[dict]:
    messages = _get(body, "messages", (list,))
    if not messages:
        raise RequestError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"'{where}' must be an object with a string 'role'", where)
        content = m.get("content")
        if isinstance(content, list):       # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"'{where}.content' parts must be text parts "
                                   f"({{\"type\": \"text\", \"text\": ...}}); this model "
                                   f"reads text only", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or an array of text parts",
                               f"{where}.content")
        out.append({"role": m["role"], "content": content})
    return out


def completion_prompt(body: dict, vocab: int):
    """A string or a list of token ids (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {vocab})", "prompt")
        return prompt
    raise RequestError("'prompt' must be a non-empty string or a non-empty array of token ids "
                       "(one prompt per request)", "prompt")


def check_model(body: dict, model_id: str):
    model = _get(body, "model", (str,))
    if model is not None and model != model_id:
        raise RequestError(f"model '{model}' is not served here; this server serves "
                           f"'{model_id}'", "model", "model_not_found")


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", (bool,)))
    opts = _get(body, "stream_options", (dict,)) or {}
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean",
                           "stream_options.include_usage")
    return stream, bool(usage)


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class Job:
    prompt: list[int]
    options: dict
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, item):
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, item))
        except RuntimeError:        # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()


class Engine:
    """The thread that owns the pair and serves jobs one at a time, in arrival order.

    ``load()`` runs on the thread and returns the pair; ``max_queue`` jobs may wait while one
    runs (more are refused); ``cache_bytes`` bounds the prefix cache (0: no reuse, every
    request is prefilled from scratch)."""

    def __init__(self, load, max_queue: int, cache_bytes: int, decode_options: dict):
        self.load, self.max_queue, self.decode_options = load, max_queue, decode_options
        self.cache = PrefixCache(cache_bytes) if cache_bytes > 0 else None
        self.pair = None
        self._jobs: queue.Queue = queue.Queue()
        self._active = 0            # jobs submitted and not finished (waiting or running)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._current: Job | None = None
        self.served = self.cancelled = 0    # generations finished, and stopped early
        self._thread = threading.Thread(target=self._main, name="mlx-dspark-engine",
                                        daemon=True)

    def start(self):
        """Start the thread and wait for the pair; a load error is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def cancel_all(self, reason: str):
        """End every request with an error event: the waiting ones never start, the running
        one stops at its next token."""
        jobs = [self._current]
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job is not None:
                job.cancelled.set()
                job.emit("error", reason)

    def stop(self):
        """Cancel what is left and end the thread (the generation in flight stops at its next
        token)."""
        if self._thread.is_alive():
            self.cancel_all("the server is shutting down")
            self._jobs.put(None)
            self._thread.join()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job):
        with self._lock:
            if self._active > self.max_queue:
                raise RequestError(f"the server is busy: one generation is running and "
                                   f"{self.max_queue} requests are waiting (--max-queue); "
                                   f"retry later", status=503, type="server_error",
                                   code="server_busy")
            self._active += 1
        self._jobs.put(job)

    def _main(self):
        try:
            self.pair = self.load()
            self.session = self.pair.session(self.decode_options["speculative"])
        except BaseException as e:        # reported by start() on the main thread
            self._load_error = e
            return
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            self._current = job
            try:
                if not job.cancelled.is_set():
                    self._run(job)
            except Exception as e:
                log.exception("generation failed")
                self.session.reset()          # the state may be half-updated
                job.emit("error", f"generation failed: {type(e).__name__}")
            finally:
                self._current = None
                with self._lock:
                    self._active -= 1

    def _run(self, job: Job):
        session = self.session
        snap = self.cache.find(job.prompt) if self.cache is not None else None
        if snap is not None:
            session.restore(snap)
        else:
            session.reset()
        stream = api.stream_generate(self.pair, job.prompt, session=session,
                                     **self.decode_options, **job.options)
        try:
            for i, chunk in enumerate(stream):
                job.emit("chunk", chunk)
                if i == 0:
                    self._remember()          # the prompt's state, before any answer token
                if job.cancelled.is_set() and chunk.finish_reason is None:
                    self.cancelled += 1
                    break
            else:
                self.served += 1
        finally:
            stream.close()
        self._remember()                      # prompt and answer: the next turn's prefix

    def _remember(self):
        if self.cache is not None and not self.cache.touch(self.session.tokens):
            self.cache.add(self.session.snapshot())


# ---------------------------------------------------------------------------------------------
# Responses


class Reply:
    """Accumulates the chunks of one generation into OpenAI response objects."""

    def __init__(self, kind: str, model: str, stop_tokens=()):
        self.kind, self.model = kind, model
        self.stop_tokens = set(stop_tokens)     # a final stop token is not an answer token
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text: list[str] = []
        self.tokens = 0
        self.stats: dict = {}

    def add(self, chunk) -> str:
        self.text.append(chunk.text)
        self.tokens += not (chunk.finish_reason == "stop" and chunk.token in self.stop_tokens)
        self.stats = chunk.stats
        return chunk.text

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stats.get("finish_reason") == "stop" else "length"

    def usage(self) -> dict:
        prompt = self.stats.get("prompt_tokens", 0)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.stats.get("reused_tokens", 0)}}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self) -> dict:
        text = "".join(self.text)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": self.usage(),
                "dspark": self.stats}

    def piece(self, text: str, first: bool = False, finish: str | None = None) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else \
                {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_piece(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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


# ---------------------------------------------------------------------------------------------
# The app


def create_app(engine: Engine, model_id: str, api_key: str | None = None) -> Starlette:
    """The ASGI app; ``engine`` must be started (its pair loaded)."""
    tokenizer = engine.pair.tokenizer
    limit = engine.pair.target.context_limit
    vocab = engine.pair.target.config.vocab_size

    def authorize(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("missing or wrong API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key", status=401)

    async def read(request: Request, kind: str) -> Params:
        authorize(request)
        body = parse_body(await request.body())
        check_model(body, model_id)
        stream, include_usage = stream_flags(body)
        if kind == "chat":
            where, prompt = "messages", chat_messages(body)
        else:
            where, prompt = "prompt", completion_prompt(body, vocab)
        options = sampling_options(body, COMPLETIONS_MAX_TOKENS if kind != "chat" else None)
        if kind != "chat" and isinstance(prompt, list):
            ids = prompt
        else:
            template = _get(body, "chat_template_kwargs", (dict,)) if kind == "chat" else None
            try:
                ids = await run_in_threadpool(encode, tokenizer, prompt, kind == "chat", template)
            except Exception as e:   # no chat template, or the template refuses the messages
                raise RequestError(f"'{where}' cannot be encoded: "
                                   f"{' '.join(str(e).split()) or type(e).__name__}",
                                   where) from None
        if not ids:
            raise RequestError(f"'{where}' encodes to no tokens", where)
        if limit is not None:
            if len(ids) >= limit:
                raise RequestError(f"the prompt has {len(ids)} tokens; this model's context "
                                   f"limit is {limit}, leaving no room for an answer", where,
                                   "context_length_exceeded")
            options["max_tokens"] = min(options["max_tokens"] or limit, limit - len(ids))
        return Params(ids, options, stream, include_usage)

    async def complete(request: Request, kind: str):
        params = await read(request, kind)
        job = Job(params.prompt, params.options, asyncio.get_running_loop())
        engine.submit(job)
        reply = Reply(kind, model_id, tokenizer.eos_token_ids)
        if not params.stream:
            async for what, item in _events(job):
                if what == "error":
                    raise RequestError(item, status=500, type="server_error")
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
                    yield _sse({**end, "dspark": reply.stats})
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
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-dspark"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, "waiting": engine.waiting,
                             "served": engine.served, "cancelled": engine.cancelled,
                             "prefix_cache": None if engine.cache is None else
                             {"snapshots": len(engine.cache), "bytes": engine.cache.nbytes,
                              "budget_bytes": engine.cache.budget}})

    async def refused(request: Request, e: RequestError):
        return error_response(e)

    async def http_error(request: Request, e: HTTPException):
        return error_response(RequestError(
            f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
            code="not_found" if e.status_code == 404 else None))

    async def crashed(request: Request, e: Exception):
        log.exception("request failed")
        return error_response(RequestError(f"internal error ({type(e).__name__})",
                                           status=500, type="server_error"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()       # at shutdown, before uvicorn hands a Ctrl-C or SIGTERM back

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        RequestError: refused, HTTPException: http_error, Exception: crashed})


def serve(engine: Engine, model_id: str, host: str, port: int, api_key: str | None):
    """Run until Ctrl-C or SIGTERM: the generation in flight stops at its next token, every
    open request ends with an error event, uvicorn closes the connections and the engine
    thread ends."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.cancel_all("the server is shutting down")
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(engine, model_id, api_key), host=host, port=port,
                            log_level="info", timeout_graceful_shutdown=5)
    Server(config).run()


def launch(flags=(), timeout: float = 60.0, **popen):
    """Start ``mlx-dspark serve FLAGS`` in a child process on a free port of 127.0.0.1 and
    wait until it answers ``/health``; returns the process and the base URL (for tests,
    benchmarks and scripts that drive a real server)."""
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_dspark.cli", "serve", "--port",
                             str(port), *flags], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"mlx-dspark serve {' '.join(flags)} did not start (exit status "
                       f"{proc.wait()})")
