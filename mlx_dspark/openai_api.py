"""OpenAI request and response shapes for ``mlx-dspark serve`` (docs/serve.md): reading a
JSON body into a :class:`~mlx_dspark.request.Request`'s options, refusing what does not fit
with an OpenAI error object, and building completion objects and stream pieces from chunks.
No engine, no HTTP server: those are engine.py and server.py."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from starlette.responses import JSONResponse

COMPLETIONS_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat runs to the limit
MAX_STOPS = 4                   # as OpenAI


class ApiError(Exception):
    """A request the server refuses: HTTP status and an OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = \
            message, param, code, status, type


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param,
                                   "code": e.code}}, status_code=e.status, headers=headers)


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Params:
    """What a request asks for, checked: the generation, and how to send it back."""

    request: object             # request.Request
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
        raise ApiError(f"'{name}' must be {want}, not {json.dumps(value)[:40]}", name)
    if check is not None and not check(value):
        raise ApiError(f"'{name}' must be {what}, not {value}", name)
    return value


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def sampling_options(body: dict, default_max_tokens: int | None,
                     defaults: dict | None = None) -> dict:
    """api.make_request keyword arguments from the OpenAI sampling fields; a field the body
    leaves out takes the server's default (``defaults``: ``serve --temp`` ... or the model's
    generation_config.json), else OpenAI's."""
    defaults = {**OPENAI_DEFAULTS, **(defaults or {})}
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
        raise ApiError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} non-empty strings", "stop")
    n = _get(body, "n", (int,))
    if n not in (None, 1):
        raise ApiError("'n' must be 1: this server returns one choice per request", "n")
    return dict(max_tokens=max_tokens or defaults.get("max_tokens") or default_max_tokens,
                temperature=float(temperature if temperature is not None
                                  else defaults["temperature"]),
                top_p=float(top_p if top_p is not None else defaults["top_p"]),
                top_k=top_k if top_k is not None else defaults["top_k"], seed=seed, stop=stop)


def chat_messages(body: dict) -> list[dict]:
    messages = _get(body, "messages", (list,))
    if not messages:
        raise ApiError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"'{where}' must be an object with a string 'role'", where)
        content = m.get("content")
        if isinstance(content, list):       # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(f"'{where}.content' parts must be text parts "
                                   f"({{\"type\": \"text\", \"text\": ...}}); this model "
                                   f"reads text only", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(f"'{where}.content' must be a string or an array of text parts",
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
            raise ApiError(f"'prompt' token ids must be in [0, {vocab})", "prompt")
        return prompt
    raise ApiError("'prompt' must be a non-empty string or a non-empty array of token ids "
                       "(one prompt per request)", "prompt")


def check_model(body: dict, model_ids):
    """``model`` absent, or one of the names the server answers to (``model_ids``: its id
    first, then the name, path or repo id it was started with)."""
    model = _get(body, "model", (str,))
    if model is not None and model not in model_ids:
        raise ApiError(f"model '{model}' is not served here; this server serves "
                       f"'{model_ids[0]}'", "model", "model_not_found")


def model_object(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-dspark"}


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", (bool,)))
    opts = _get(body, "stream_options", (dict,)) or {}
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError("'stream_options.include_usage' must be a boolean",
                           "stream_options.include_usage")
    return stream, bool(usage)


# ---------------------------------------------------------------------------------------------
# Responses


class Reply:
    """Accumulates the chunks of one generation into OpenAI response objects."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text: list[str] = []
        self.tokens = 0
        self.stats = None

    def add(self, chunk) -> str:
        self.text.append(chunk.text)
        self.tokens += not chunk.stop          # a final stop token is not an answer token
        self.stats = chunk.stats
        return chunk.text

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stats.finish_reason == "stop" else "length"

    def usage(self) -> dict:
        prompt = self.stats.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.stats.reused_tokens}}

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
                "dspark": self.stats.as_dict()}

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
