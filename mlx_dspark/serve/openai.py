"""OpenAI request and response shapes for ``mlx-dspark serve`` (docs/serve.md): reading a
JSON body into what it asks (:func:`read`: an :class:`~mlx_dspark.serve.asked.Asked`, the
keywords of its one Request), refusing what does not fit with an OpenAI error object, and
building completion objects and stream pieces from chunks. No engine, no HTTP server: those
are serve/engine.py and serve/routes.py."""

from __future__ import annotations

import json
import math
import time
import uuid

from ..media import parts
from ..request import REPETITION_PENALTY, RequestError
from ..text import tools
from ..text.chat_template import check_template_variables
from . import fields
from .fields import typed
from .answer import Answer, one_call_stops
from .asked import Asked, Defaults, ToolUse
from .errors import ApiError

COMPLETIONS_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat runs to the limit
MAX_STOPS = 4                   # as OpenAI; for Anthropic's stop_sequences too
MAX_STOP_CHARS = 1000           # per stop string (held back while it may be forming)
MAX_TOP_LOGPROBS = 20           # as OpenAI
MAX_DEPTH = 32                  # JSON nesting: chat needs 4, tools add their schemas' depth


# ---------------------------------------------------------------------------------------------
# Requests


def read(body: dict, kind: str, defaults: Defaults, vocab: int) -> Asked:
    """A /v1/chat/completions (``kind`` "chat") or /v1/completions ("completion") body
    checked and read, the server's ``defaults`` merged in (``vocab``: the model's, which a
    completion's token ids must be within). A completion is the model's text as written:
    its thinking and closing tag come back as text (the completions shape has no other
    place for them)."""
    fields.check(body, kind)
    model = typed(body, "model", (str,))
    stream, include_usage = stream_flags(body)
    options = sampling_options(body, COMPLETIONS_MAX_TOKENS if kind != "chat" else None,
                               defaults)
    options.update(logprobs=logprobs_request(body, kind), **defaults.engine())
    if kind != "chat":
        return Asked("prompt", completion_prompt(body, vocab),
                     dict(options, split_thinking=False),
                     constraints=lambda: constraint_options(body, ToolUse()), model=model,
                     stream=stream, include_usage=include_usage)
    messages, use = chat_messages(body), tool_use(body)
    template, budget = thinking_options(body, defaults.chat_template_kwargs)
    options.update(stop=options["stop"] + one_call_stops(use), thinking_token_budget=budget)
    return Asked("messages", messages, options, template, use,
                 constraints=lambda: constraint_options(body, use), model=model,
                 stream=stream, include_usage=include_usage)


def parse_body(raw: bytes) -> dict:
    too_deep = ApiError(f"the request body nests JSON deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:          # deeper than the interpreter's recursion limit
        raise too_deep from None
    if _depth(body) > MAX_DEPTH:
        raise too_deep
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _depth(value) -> int:
    """How deep ``value`` nests arrays and objects (iteratively: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((v, depth + 1) for v in
                            (value.values() if isinstance(value, dict) else value))
    return deepest


def text_chars(*values) -> int:
    """Characters in every string in ``values``, object keys included (a tool schema's
    property names are rendered too): what a chat template may write of them. Walked
    iteratively, as :func:`_depth`."""
    total, todo = 0, list(values)
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict) and not parts.is_media(value):   # media: counted once
            todo.extend(value)                                          # encoded
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
    return total


def sampling_options(body: dict, default_max_tokens: int | None,
                     defaults: Defaults) -> dict:
    """api.make_request keyword arguments from the OpenAI sampling fields; a field the body
    leaves out takes the server's default (``defaults``: ``serve --temp`` ... or the model's
    generation_config.json, else OpenAI's)."""
    num = (int, float)
    temperature = typed(body, "temperature", num, lambda t: 0 <= t <= 2 and math.isfinite(t),
                       "between 0 and 2")
    top_p = typed(body, "top_p", num, lambda p: 0 < p <= 1, "in (0, 1]")
    top_k = typed(body, "top_k", (int,), lambda k: k >= 0, "0 (off) or more")
    seed = typed(body, "seed", (int,), lambda s: 0 <= s < 2**64, "in [0, 2**64)")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        max_tokens = typed(body, name, (int,), lambda n: n >= 1, "at least 1")
        if max_tokens is not None:
            break
    stop = typed(body, "stop", (str, list))
    stop = stop_strings([stop] if isinstance(stop, str) else stop or [], "stop")
    n = typed(body, "n", (int,))
    if n not in (None, 1):
        raise ApiError("'n' must be 1: this server returns one choice per request", "n")
    return dict(max_tokens=max_tokens or defaults.max_tokens or default_max_tokens,
                temperature=float(temperature if temperature is not None
                                  else defaults.temperature),
                top_p=float(top_p if top_p is not None else defaults.top_p),
                top_k=top_k if top_k is not None else defaults.top_k, seed=seed, stop=stop,
                **penalty_options(body))


def penalty_options(body: dict) -> dict:
    """api.make_request keywords from the penalty fields a body sets: OpenAI's
    ``presence_penalty``, ``frequency_penalty`` (-2..2) and ``logit_bias`` (token id strings
    to -100..100), mlx-lm's server's ``repetition_penalty``, ``repetition_context_size`` and
    ``min_p``; each honoured exactly under speculation (docs/sampling.md)."""
    num = (int, float)
    least, most = REPETITION_PENALTY
    checks = {
        "presence_penalty": (num, lambda v: -2 <= v <= 2, "between -2 and 2"),
        "frequency_penalty": (num, lambda v: -2 <= v <= 2, "between -2 and 2"),
        "repetition_penalty": (num, lambda v: least <= v <= most,
                               f"in [{least:g}, {most:g}] (1 = off)"),
        "repetition_context_size": ((int,), lambda v: v >= 1, "at least 1"),
        "min_p": (num, lambda v: 0 <= v <= 1, "in [0, 1]"),
    }
    out = {}
    for name, (kinds, check, what) in checks.items():
        value = typed(body, name, kinds, check, what)
        if value is not None:
            out[name] = value
    bias = typed(body, "logit_bias", (dict,))
    if bias:
        out["logit_bias"] = token_biases(bias)
    return out


def token_biases(bias: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias`` object (token ids as strings) as {id: bias}; a 400 naming it
    unless every key is an id and every value a number in [-100, 100]."""
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise ApiError(f"'logit_bias' maps token ids (strings of digits) to numbers "
                           f"between -100 and 100, not {key!r}: {json.dumps(value)[:40]}",
                           "logit_bias")
        out[int(key)] = value
    return out


def stop_strings(stops: list, name: str) -> list[str]:
    """``stops`` (the field ``name``) checked: at most MAX_STOPS non-empty strings of at most
    MAX_STOP_CHARS characters, which bounds the text a stream holds back for them."""
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                         for s in stops):
        raise ApiError(f"'{name}' takes at most {MAX_STOPS} stop strings, each non-empty and "
                       f"at most {MAX_STOP_CHARS} characters long", name)
    return stops


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _content(content, where: str, empty_ok: bool = False) -> str | list:
    if isinstance(content, list):       # content parts: text, images (data URLs), audio
        bad = next((j for j, p in enumerate(content) if not parts.is_media(p) and not (
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))),
            None)
        if bad is not None:
            raise ApiError(f"'{where}[{bad}]' must be a text, image_url or input_audio part",
                           f"{where}[{bad}]")
        return parts.content([parts.located(p, f"{where}[{j}]") if parts.is_media(p)
                              else p["text"] for j, p in enumerate(content)])
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ApiError(f"'{where}' must be a string or an array of text parts", where)
    return content


def constraint_options(body: dict, use: ToolUse) -> dict:
    """api.make_request's grammar keywords: ``response_format`` (text, json_object,
    json_schema), or for a forced ``tool_choice`` (``use.prefill``, the call's opening the
    prompt ends with) the grammar of the rest of Nemotron's tool calls to ``tools``
    (grammar.tool_calls), so that the call is well formed and its arguments typed."""
    from ..grammar import grammars as grammar
    from ..request import RequestError
    response_format = typed(body, "response_format", (dict,))
    if not use.prefill:
        return {"response_format": response_format} if response_format else {}
    if response_format and response_format.get("type") != "text":
        raise ApiError("'response_format' and a forced 'tool_choice' cannot both constrain "
                       "the answer", "response_format")
    try:
        return {"grammar": grammar.tool_calls(use.tools, parallel=use.parallel,
                                              prefix=use.prefill)}
    except RequestError as e:
        raise ApiError(str(e), e.param) from None


def chat_messages(body: dict) -> list[dict]:
    """The messages as the chat template takes them: roles (``developer`` is ``system``),
    text content, an assistant's ``tool_calls`` with their arguments as objects, a tool
    result's ``tool_call_id``."""
    messages = typed(body, "messages", (list,))
    if not messages:
        raise ApiError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"'{where}' must be an object with a string 'role'", where)
        role = ROLES.get(m["role"])
        if role is None:
            raise ApiError(f"'{where}.role' must be one of {', '.join(ROLES)}, not "
                           f"{m['role']!r}", f"{where}.role")
        message = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _history_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
        out.append(message)
    return out


def _history_calls(calls, where: str) -> list[dict]:
    """An assistant's earlier calls, arguments parsed (the template writes them back)."""
    if not isinstance(calls, list):
        raise ApiError(f"'{where}' must be an array of tool calls", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(f"'{where}[{j}]' must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"arguments\": ...}}}}", f"{where}[{j}]")
        args = f.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ApiError(f"'{where}[{j}].function.arguments' must be a JSON object",
                           f"{where}[{j}].function.arguments")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def tool_use(body: dict) -> ToolUse:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` read and checked. "auto" (the
    default with tools): the model may call; "none": the tools are not shown; "required" and
    a named function: the reply starts with the opening of a call (the prompt's prefill)
    and the rest is held to well-formed calls by grammar (:func:`constraint_options`).
    ``parallel_tool_calls: false``: a forced reply's grammar allows one call; on "auto" the
    reply ends after its first complete call (answer.one_call_stops)."""
    defs = typed(body, "tools", (list,))
    for j, t in enumerate(defs or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError(f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": {{...}}}}}}", f"tools[{j}]")
        typed(f, "description", (str,), at=f"tools[{j}].function")
        tool_parameters(f.get("parameters"), f"tools[{j}].function.parameters")
    parallel = typed(body, "parallel_tool_calls", (bool,)) is not False
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    names = tools.schemas(defs)
    if choice == "none" or not defs:
        if choice not in ("none", "auto"):
            raise ApiError("'tool_choice' needs 'tools'", "tool_choice")
        return ToolUse()
    if choice == "auto":
        return ToolUse(defs, names, parallel=parallel)
    if choice == "required":
        return ToolUse(defs, names, tools.START + "\n", parallel)
    name = typed(choice["function"], "name", (str,), at="tool_choice.function") \
        if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise ApiError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": "
                       "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ApiError(f"'tool_choice' names {name!r}, which is not among 'tools'",
                       "tool_choice")
    return ToolUse(defs, names, f"{tools.START}\n<function={name}>\n", parallel)


def tool_parameters(schema, where: str) -> dict:
    """A tool's parameters, as the chat template renders them, checked (``where``: their
    JSON path): a JSON schema object whose ``properties``, if any, are objects and whose
    ``required``, if any, is an array of names."""
    if schema is None:
        return {}
    if not isinstance(schema, dict):
        raise ApiError(f"'{where}' must be a JSON schema (an object)", where)
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict):       # null too: the template reads it as given
        raise ApiError(f"'{where}.properties' must be an object", f"{where}.properties")
    for name, spec in properties.items():
        at = f"{where}.properties.{name}"
        if not isinstance(spec, dict):
            raise ApiError(f"'{at}' must be a JSON schema (an object)", at)
        kinds = spec.get("type")
        if kinds is not None and not isinstance(kinds, str) and not (
                isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
            raise ApiError(f"'{at}.type' must be a type name or an array of them", f"{at}.type")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ApiError(f"'{where}.required' must be an array of parameter names, not "
                       f"{json.dumps(required)[:60]}", f"{where}.required")
    return schema


def thinking_options(body: dict, defaults: dict) -> tuple[dict, int | None]:
    """Chat template variables (the server's ``--chat-template-args``, then the request's
    ``chat_template_kwargs``; ``reasoning_effort: "none"`` turns thinking off, another level
    turns it on) and the thinking budget (``thinking_token_budget``, else the effort's,
    fields.EFFORT_BUDGETS)."""
    options = dict(defaults)
    variables = typed(body, "chat_template_kwargs", (dict,)) or {}
    try:
        check_template_variables(variables)
    except RequestError as e:
        raise ApiError(str(e), e.param) from None
    options.update(variables)
    effort = typed(body, "reasoning_effort", (str,))
    budget = None
    if effort is not None:      # an effort level: thinking on with its budget, or off
        on, budget = fields.effort_budget(effort, "reasoning_effort")
        options["enable_thinking"] = on
    given = typed(body, "thinking_token_budget", (int,), lambda n: n >= 0, "0 or more")
    return options, given if given is not None else budget


def logprobs_request(body: dict, kind: str) -> int | None:
    """How many alternatives per token to return with its log-probability (None: no
    logprobs). Chat: ``logprobs: true`` and ``top_logprobs`` 0..20; completions:
    ``logprobs`` 0..5."""
    if kind != "chat":
        return typed(body, "logprobs", (int,), lambda n: 0 <= n <= 5, "in [0, 5]")
    on = typed(body, "logprobs", (bool,))
    top = typed(body, "top_logprobs", (int,), lambda n: 0 <= n <= MAX_TOP_LOGPROBS,
               f"in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not on:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


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


def model_object(model_id: str, context: int | None = None) -> dict:
    """A model as ``/v1/models`` lists it: OpenAI's fields and Anthropic's (``type``,
    ``display_name``, ``created_at``), so clients of either API read it; and what agents read
    of a model where it is known: its context in tokens under the names clients look for
    (vLLM's ``max_model_len``, OpenRouter's ``context_length``, Codex's model metadata
    ``context_window``) and Codex's ``input_modalities`` (text only: no images)."""
    known = {} if context is None else {"max_model_len": context, "context_length": context,
                                        "context_window": context}
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-dspark",
            "type": "model", "display_name": model_id, "created_at": "1970-01-01T00:00:00Z",
            **known, "input_modalities": ["text"]}


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(typed(body, "stream", (bool,)))
    opts = typed(body, "stream_options", (dict,)) or {}
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError("'stream_options.include_usage' must be a boolean",
                           "stream_options.include_usage")
    return stream, bool(usage)


# ---------------------------------------------------------------------------------------------
# Responses


class Reply:
    """Accumulates the chunks of one generation into OpenAI response objects: the thinking
    as ``reasoning_content``, the text as ``content``, the calls as ``tool_calls``."""

    def __init__(self, kind: str, model: str, use: ToolUse | None = None):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.answer = Answer.of(use or ToolUse())
        self.logprobs = None        # set by the engine's scores, when asked for

    def add(self, chunk) -> list:
        return self.answer.add(chunk)

    @property
    def stats(self):
        return self.answer.stats

    @property
    def finish_reason(self) -> str:
        return self.answer.finish_reason

    def ends(self) -> dict:
        """The choice's finish fields: ``finish_reason``, and for "length" ``finish_detail``,
        what cut it: "max_tokens" or "context" (the model's context limit; OpenAI's reason
        stays "length", as its clients expect)."""
        out = {"finish_reason": self.finish_reason}
        if self.finish_reason == "length":
            out["finish_detail"] = self.stats.finish_detail
        return out

    def usage(self) -> dict:
        prompt, tokens = self.stats.prompt_tokens, self.answer.tokens
        usage = {"prompt_tokens": prompt, "completion_tokens": tokens,
                 "total_tokens": prompt + tokens,
                 "prompt_tokens_details": {"cached_tokens": self.stats.reused_tokens}}
        if self.kind == "chat":
            usage["completion_tokens_details"] = {
                "reasoning_tokens": self.answer.reasoning_tokens}
        return usage

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self) -> dict:
        a = self.answer
        text = "".join(a.text)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text or (None if a.calls else "")}
            if a.reasoning:
                message["reasoning_content"] = "".join(a.reasoning)
            if a.calls:
                message["tool_calls"] = [c.openai() for c in a.calls]
            choice = {"index": 0, "message": message, "logprobs": self.logprobs,
                      **self.ends()}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs, **self.ends()}
            obj = "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": self.usage(),
                "dspark": self.stats.as_dict()}

    def pieces(self, events: list) -> list[dict]:
        """Stream pieces for the new events of one chunk."""
        out = []
        for kind, item in events:
            if self.kind != "chat":
                out.append(self._piece({"text": item}))
            elif kind == "call":
                index = self.answer.calls.index(item)
                out.append(self._delta({"tool_calls": [{
                    "index": index, "id": item.id, "type": "function",
                    "function": {"name": item.name, "arguments": ""}}]}))
                out.append(self._delta({"tool_calls": [{
                    "index": index, "function": {"arguments": item.arguments_json}}]}))
            else:
                field = "reasoning_content" if kind == "reasoning" else "content"
                out.append(self._delta({field: item}))
        return out

    def first_piece(self) -> dict:
        """The stream's first piece: the role (chat), before any text."""
        return self._delta({"role": "assistant"}) if self.kind == "chat" else \
            self._piece({"text": ""})

    def end_piece(self) -> dict:
        end = self._delta({}) if self.kind == "chat" else self._piece({"text": ""})
        end["choices"][0].update(self.ends())
        end["choices"][0]["logprobs"] = self.logprobs
        return {**end, "dspark": self.stats.as_dict()}

    def _delta(self, delta: dict) -> dict:
        return self._piece({"delta": delta})

    def _piece(self, body: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [{"index": 0, **body, "logprobs": None,
                                                "finish_reason": None}]}

    def usage_piece(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
