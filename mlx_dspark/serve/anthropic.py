"""Anthropic Messages API shapes for ``mlx-dspark serve`` (``POST /v1/messages``,
docs/serve.md): a request body read into chat messages, tools and options, refusals as
Anthropic error objects, and the reply as a message or as Anthropic's stream of events. The
engine, the prompt encoding and the reading of thinking and tool calls are the OpenAI
endpoint's (serve/routes.py, serve/answer.py); only the shapes differ."""

from __future__ import annotations

import json
import uuid

from ..media import parts
from ..text import tools
from . import fields
from .answer import Answer, one_call_stops
from .asked import Asked, Defaults, ToolUse
from .errors import ApiError
from .fields import typed
from .openai import constraint_options, stop_strings, tool_parameters

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def read(body: dict, defaults: Defaults, count: bool = False) -> Asked:
    """A /v1/messages body checked and read (``count``: a count_tokens body, which needs no
    ``max_tokens``). Anthropic's own defaults (temperature 1, no top_k) stand where the body
    leaves a field out; of the server's, only the engine's options apply."""
    model = None if count else typed(body, "model", (str,))
    fields.check(body, "count_tokens" if count else "messages")
    max_tokens = typed(body, "max_tokens", (int,), lambda n: n >= 1, "at least 1")
    if max_tokens is None and not count:
        raise ApiError("'max_tokens' is required", "max_tokens")
    num = (int, float)
    temperature = typed(body, "temperature", num, lambda t: 0 <= t <= 1, "between 0 and 1")
    top_p = typed(body, "top_p", num, lambda p: 0 < p <= 1, "in (0, 1]")
    top_k = typed(body, "top_k", (int,), lambda k: k >= 0, "0 (off) or more")
    stops = stop_strings(typed(body, "stop_sequences", (list,)) or [], "stop_sequences")
    template, budget = _thinking(body)
    system = _system(body.get("system"))
    messages = ([{"role": "system", "content": system}] if system else []) + \
        _messages(typed(body, "messages", (list,)))
    prefill = _prefill(messages)
    if prefill and template["enable_thinking"]:
        raise ApiError("'thinking' and a last assistant message (a prefill) do not go "
                       "together: the reply would continue the prefill, not think first",
                       "thinking")
    use = _tools(body)
    options = dict(max_tokens=max_tokens,
                   temperature=float(temperature) if temperature is not None else 1.0,
                   top_p=float(top_p) if top_p is not None else 1.0, top_k=top_k or 0,
                   stop=stops + one_call_stops(use), thinking_token_budget=budget,
                   **defaults.engine())
    return Asked("messages", messages, options, template, use, prefill,
                 lambda: constraint_options({}, use), model,         # forced calls' grammar
                 stream=bool(typed(body, "stream", (bool,))))


def _prefill(messages: list[dict]) -> str:
    """A last assistant message's text, taken off ``messages``: the start of the reply, which
    the model continues (as Anthropic's API does), written as given after the generation
    prompt rather than closed as a past turn (which would also trim it)."""
    last = messages[-1]
    if last["role"] != "assistant" or "tool_calls" in last:
        return ""
    messages.pop()
    return last["content"]


def _thinking(body: dict) -> tuple[dict, int | None]:
    """``thinking: {"type": "enabled", "budget_tokens": N}`` turns thinking on with that
    budget; ``{"type": "adaptive"}`` turns it on with the budget of ``output_config.effort``
    (fields.EFFORT_BUDGETS; none without an effort); without it (or ``"disabled"``) the
    model does not think, as Anthropic's API."""
    thinking = typed(body, "thinking", (dict,))
    config = typed(body, "output_config", (dict,)) or {}
    extra = sorted(set(config) - {"effort"})
    if extra:
        raise ApiError(f"'output_config.{extra[0]}' is not supported (only 'effort')",
                       f"output_config.{extra[0]}", "unsupported_parameter")
    effort = config.get("effort")
    _, by_effort = fields.effort_budget(effort, "output_config.effort") \
        if effort is not None else (True, None)
    if thinking is None or thinking.get("type") == "disabled":
        return {"enable_thinking": False}, None
    if thinking.get("type") == "adaptive":
        return {"enable_thinking": True}, by_effort
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or not isinstance(budget, int) \
            or isinstance(budget, bool) or budget < 0:
        raise ApiError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N >= 0}, "
                       "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}", "thinking")
    return {"enable_thinking": True}, budget


BILLING = "x-anthropic-billing-header:"


def _system(system) -> str:
    """The system prompt: a string, or text blocks joined. A block of Claude Code's billing
    attribution (``x-anthropic-billing-header: cc_version=…``, whose suffix changes with each
    session's first prompt) is left out: it is meant for Anthropic's billing, not for the
    model, and at the head of the prompt it would defeat prefix reuse across sessions."""
    if system is None or isinstance(system, str):
        return "" if system is None or system.startswith(BILLING) else system
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in system):
        return "".join(b["text"] for b in system if not b["text"].startswith(BILLING))
    raise ApiError("'system' must be a string or a list of text blocks", "system")


def _messages(messages) -> list[dict]:
    """Anthropic turns -> template messages: text blocks (and documents with a text source)
    join into the turn's text, an assistant's ``tool_use`` blocks become its tool calls, a
    user's ``tool_result`` blocks become tool messages; earlier ``thinking`` blocks are
    dropped (the template keeps only past answers); a ``system`` turn in the middle of the
    conversation stays a system message where it is, for the template to render."""
    if not messages:
        raise ApiError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise ApiError(f"'{where}' must be an object with role 'user', 'assistant' or "
                           f"'system'", where)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(f"'{where}.content' must be a string or a list of blocks",
                           f"{where}.content")
        text, calls, results = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content.{j}"
            if kind in ("text", "document"):
                text.append(_text(b, at))
            elif kind == "image" and m["role"] == "user":
                text.append(parts.located(b, f"messages[{i}].content[{j}]"))
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue
            elif kind == "tool_use" and m["role"] == "assistant" \
                    and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict):
                calls.append({"id": typed(b, "id", (str,), at=at), "type": "function",
                              "function": {"name": b["name"], "arguments": b["input"]}})
            elif kind == "tool_result" and m["role"] == "user":
                results.append({"role": "tool",
                                "tool_call_id": typed(b, "tool_use_id", (str,), at=at),
                                "content": _result_text(b.get("content"), at)})
            else:
                raise ApiError(f"'{at}': this server reads text, document (text source), "
                               f"image (user), tool_use (assistant) and tool_result (user) "
                               f"blocks", at)
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(text),
                        **({"tool_calls": calls} if calls else {})})
        else:
            out += results
            if text or not results:
                out.append({"role": m["role"], "content": parts.content(text)})
    return out


def _text(block: dict, where: str) -> str:
    """A text block's text, or a document's (a ``text`` source, or a ``content`` source of
    text blocks), flattened after its title and context."""
    if block["type"] == "text":
        if not isinstance(block.get("text"), str):
            raise ApiError(f"'{where}.text' must be a string", f"{where}.text")
        return block["text"]
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), (str, list)):
        body = _result_text(source["content"], f"{where}.source")
    else:
        raise ApiError(f"'{where}': a document must have a text source ({{\"type\": \"text\", "
                       f"\"data\": ...}} or text content); this model reads text only", where)
    head = [f"{k}: {block[k]}" for k in ("title", "context") if isinstance(block.get(k), str)]
    return "\n".join(head + [body])


def _result_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         for b in content):
        return "".join(typed(b, "text", (str,), at=f"{where}.content.{j}") or ""
                       for j, b in enumerate(content))
    raise ApiError(f"'{where}.content' must be a string or text blocks", f"{where}.content")


def _tools(body: dict) -> ToolUse:
    """``tools`` and ``tool_choice``. Tools of Anthropic's own kinds (a ``type`` such as
    ``web_search_20250305`` or ``bash_20250124``: run by Anthropic, or with a schema only its
    models know) are not offered to the model; a ``tool_choice`` naming one is a 400.
    ``disable_parallel_tool_use``: one call (by grammar when forced, else the reply ends
    after its first call)."""
    given = typed(body, "tools", (list,)) or []
    for j, t in enumerate(given):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) \
                or not isinstance(t.get("input_schema", {}), dict):
            raise ApiError(f"'tools.{j}' must be {{\"name\": ..., \"input_schema\": {{...}}}}",
                           f"tools.{j}")
        typed(t, "description", (str,), at=f"tools.{j}")
        typed(t, "type", (str,), at=f"tools.{j}")
        tool_parameters(t.get("input_schema"), f"tools.{j}.input_schema")
    defs = [t for t in given if t.get("type") in (None, "custom")]
    choice = typed(body, "tool_choice", (dict,)) or {"type": "auto"}
    kind = typed(choice, "type", (str,), at="tool_choice")
    typed(choice, "name", (str,), at="tool_choice")
    if kind == "tool" and choice.get("name") in {t["name"] for t in given} - \
            {t["name"] for t in defs}:
        raise ApiError(f"'tool_choice' names {choice['name']!r}, a tool of Anthropic's that "
                       f"this server does not offer to the model", "tool_choice")
    if not defs or kind == "none":
        if kind not in ("auto", "none"):
            raise ApiError("'tool_choice' needs 'tools'", "tool_choice")
        return ToolUse()
    single = bool(typed(choice, "disable_parallel_tool_use", (bool,), at="tool_choice"))
    openai = [{"type": "function", "function": {"name": t["name"],
                                                "description": t.get("description", ""),
                                                "parameters": t.get("input_schema") or {}}}
              for t in defs]
    names = tools.schemas(openai)
    if kind == "auto":
        return ToolUse(openai, names, parallel=not single)
    if kind == "any":
        return ToolUse(openai, names, tools.START + "\n", not single)
    if kind == "tool" and choice.get("name") in names:
        return ToolUse(openai, names, f"{tools.START}\n<function={choice['name']}>\n",
                       not single)
    raise ApiError("'tool_choice' must be auto, any, none, or a tool among 'tools'",
                   "tool_choice")


class MessageReply:
    """Accumulates one generation into an Anthropic message, or into its stream events."""

    def __init__(self, model: str, use: ToolUse, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.answer = Answer.of(use)
        self.reused = 0          # prompt tokens continued from a snapshot (engine's "started")
        self.stop_sequence = None
        self.block = None        # (index, kind) of the block being streamed
        self.blocks = 0

    def add(self, chunk) -> list:
        if chunk.finish_reason is not None and chunk.stop_string is not None \
                and not self.answer.ours(chunk):
            self.stop_sequence = chunk.stop_string
        self.reused = chunk.stats.reused_tokens
        return self.answer.add(chunk)

    @property
    def stop_reason(self) -> str:
        if self.stop_sequence is not None:
            return "stop_sequence"
        if self.answer.finish_reason == "length" and self.answer.stats.finish_detail == "context":
            return "model_context_window_exceeded"   # Anthropic's: the context window filled
        return STOP_REASONS[self.answer.finish_reason]

    def usage(self) -> dict:
        """Anthropic's usage: ``input_tokens`` are the prompt tokens prefilled, the ones
        continued from a snapshot are ``cache_read_input_tokens`` (as Anthropic counts)."""
        return {"input_tokens": self.prompt_tokens - self.reused,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.reused,
                "output_tokens": self.answer.tokens}

    def _message(self, content: list) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None,
                "usage": self.usage()}

    def whole(self) -> dict:
        a = self.answer
        content = [{"type": "thinking", "thinking": "".join(a.reasoning), "signature": ""}] \
            if a.reasoning else []
        text = "".join(a.text)
        content += [{"type": "text", "text": text}] if text or not a.calls else []
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                    for c in a.calls]
        return {**self._message(content), "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "dspark": a.stats.as_dict()}

    # -- streaming: (event name, data) pairs in Anthropic's order ----------------------------

    def start(self) -> list:
        return [("message_start", {"type": "message_start", "message": self._message([])})]

    def events(self, events: list) -> list:
        out = []
        for kind, item in events:
            if kind == "call":
                out += self._open("tool_use", {"type": "tool_use", "id": item.id,
                                               "name": item.name, "input": {}})
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": item.arguments_json}))
                out += self._close()
            elif kind == "reasoning":
                out += self._open("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": item}))
            else:
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": item}))
        return out

    def end(self) -> list:
        out = self._close()
        if self.blocks == 0 and not self.answer.calls:      # an empty answer: one empty text
            out += self._open("text", {"type": "text", "text": ""}) + self._close()
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": self.stop_reason,
                                                "stop_sequence": self.stop_sequence},
                                      "usage": self.usage()}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _open(self, kind: str, block: dict) -> list:
        if self.block is not None and self.block[1] == kind and kind != "tool_use":
            return []
        out = self._close()
        self.block = (self.blocks, kind)
        self.blocks += 1
        return out + [("content_block_start", {"type": "content_block_start",
                                               "index": self.block[0], "content_block": block})]

    def _delta(self, delta: dict):
        return ("content_block_delta", {"type": "content_block_delta", "index": self.block[0],
                                        "delta": delta})

    def _close(self) -> list:
        if self.block is None:
            return []
        index, self.block = self.block[0], None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


def ping(position: int | None) -> dict:
    """A ``ping`` event's data (Anthropic's keep-alive), with the place in the queue while
    the request waits."""
    return {"type": "ping", **({"queue_position": position} if position else {})}


def sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
