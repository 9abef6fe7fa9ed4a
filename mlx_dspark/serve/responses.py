"""OpenAI Responses API shapes for ``mlx-dspark serve`` (``POST /v1/responses``,
docs/serve.md): a request body read into chat messages, tools and options, and the reply as a
response object or as its stream of ``response.*`` events. Stateless: every request carries
its whole conversation (``previous_response_id`` is a 400). Function tools are read as chat's;
``custom`` tools (free text, or a Lark or regex grammar, as Codex sends ``apply_patch``) are
shown to the model as functions of one string ``input``, held to their grammar
(decode/tool_grammar.py) and come back as ``custom_tool_call`` items. Hosted tools
(``web_search``, ``namespace``, ``tool_search``, ...) are not offered to the model. No
engine, no HTTP."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..grammar import grammars as grammar, tools as tool_grammar
from ..media import parts
from ..request import RequestError
from ..text import tools
from . import fields
from .answer import Answer, one_call_stops
from .asked import Asked, Defaults, ToolUse
from .errors import ApiError
from .fields import typed
from .openai import constraint_options, sampling_options, tool_parameters

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Items of hosted tools (run by a provider, never here) and of past reasoning: dropped.
DROPPED = {"reasoning", "web_search_call", "file_search_call", "computer_call",
           "computer_call_output", "code_interpreter_call", "image_generation_call",
           "local_shell_call", "local_shell_call_output", "mcp_call", "mcp_list_tools",
           "mcp_approval_request", "mcp_approval_response", "tool_search_call",
           "tool_search_output", "compaction"}
CALLS = {"function_call": "arguments", "custom_tool_call": "input"}
RESULTS = ("function_call_output", "custom_tool_call_output")
INCLUDES_REFUSED = {"message.output_text.logprobs"}
# Fields the response object repeats from its request.
ECHOED = {"instructions": None, "max_output_tokens": None, "metadata": {},
          "parallel_tool_calls": True, "temperature": None, "top_p": None,
          "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
          "reasoning": {"effort": None, "summary": None}, "store": False,
          "truncation": "disabled", "user": None, "prompt_cache_key": None}


@dataclass
class ResponsesAsked(Asked):
    """A /v1/responses request as its body asks it: what every request asks, and what the
    response object needs besides."""

    customs: set = field(default_factory=set)      # names of the custom tools
    echo: dict = field(default_factory=dict)       # what the response object repeats


def read(body: dict, defaults: Defaults) -> ResponsesAsked:
    """A /v1/responses body checked and read, the server's ``defaults`` merged in."""
    model = typed(body, "model", (str,))
    fields.check(body, "responses")
    limit = typed(body, "max_output_tokens", (int,), lambda n: n >= 1, "at least 1")
    options = sampling_options({**{k: body.get(k) for k in ("temperature", "top_p", "top_k",
                                                             "seed")}, "max_tokens": limit},
                               None, defaults)
    template, budget = _reasoning(body, defaults.chat_template_kwargs)
    for j, name in enumerate(typed(body, "include", (list,)) or []):
        if not isinstance(name, str):
            raise ApiError(f"'include[{j}]' must be a string", f"include[{j}]")
        if name in INCLUDES_REFUSED:
            raise ApiError(f"'include' {name!r} is not supported", "include",
                           "unsupported_parameter")
    instructions = typed(body, "instructions", (str,))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        _input(body.get("input"))
    use, customs = _tools(body)
    echo = {k: body[k] if body.get(k) is not None else v for k, v in ECHOED.items()}
    options.update(stop=options["stop"] + one_call_stops(use), thinking_token_budget=budget,
                   **defaults.engine())
    return ResponsesAsked("input", messages, options, template, use,
                          constraints=lambda: _constraint(body, use, customs), model=model,
                          stream=bool(typed(body, "stream", (bool,))),
                          customs={c.name for c in customs}, echo=echo)


def _reasoning(body: dict, template_defaults: dict) -> tuple[dict, int | None]:
    """``reasoning.effort`` as thinking on or off and a budget (fields.EFFORT_BUDGETS);
    ``summary`` is accepted (the thinking itself comes back as reasoning text)."""
    template = dict(template_defaults)
    reasoning = typed(body, "reasoning", (dict,)) or {}
    effort = typed(reasoning, "effort", (str,), at="reasoning")
    if effort is None:
        return template, None
    template["enable_thinking"], budget = fields.effort_budget(effort, "reasoning.effort")
    return template, budget


def _input(items) -> list[dict]:
    """Input items -> template messages: messages (text parts), calls as an assistant's tool
    calls (a custom call's input as its one argument), call outputs as tool messages; past
    reasoning and hosted tools' items are dropped."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError("'input' must be a non-empty string or array of input items", "input")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"'{where}' must be an input item (an object), not "
                           f"{json.dumps(item)[:40]}", where)
        kind = typed(item, "type", (str,), at=where) or "message"
        if kind == "message":
            role = ROLES.get(typed(item, "role", (str,), at=where))
            if role is None:
                raise ApiError(f"'{where}.role' must be one of {', '.join(ROLES)}",
                               f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"),
                                                        f"{where}.content", media=True)})
        elif kind in CALLS:
            if not isinstance(item.get("name"), str):
                raise ApiError(f"'{where}.name' must be a string", f"{where}.name")
            call = {"id": typed(item, "call_id", (str,), at=where), "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(
                        item.get("arguments"), f"{where}.arguments")
                        if kind == "function_call" else
                        {tool_grammar.PARAM: typed(item, "input", (str,), at=where) or ""}}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in RESULTS:
            out.append({"role": "tool", "tool_call_id": typed(item, "call_id", (str,), at=where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind not in DROPPED:
            what = "this server is stateless: send the items themselves" \
                if kind == "item_reference" else "not an input item this server reads"
            raise ApiError(f"'{where}': {kind!r} is {what}", where)
    return out


def _text(content, where: str, media: bool = False) -> str | list:
    """Text, or with ``media`` (a message's content) text and input_image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    kinds = " (input_text, output_text" + (", input_image)" if media else ")")
    if not isinstance(content, list):
        raise ApiError(f"'{where}' must be a string or parts{kinds}", where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if media and parts.is_media(part) and part.get("type") == "input_image":
            out.append(parts.located(part, at))
        elif isinstance(part, dict) and part.get("type") in TEXT_PARTS:
            out.append(typed(part, "text", (str,), at=at) or
                       typed(part, "refusal", (str,), at=at) or "")
        else:
            raise ApiError(f"'{at}' must be a part{kinds}", at)
    return parts.content(out)


def _arguments(args, where: str) -> dict:
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(f"'{where}' must be a JSON object", where)
    return value


def _tools(body: dict) -> tuple[ToolUse, list]:
    """``tools`` and ``tool_choice`` as the chat template's tools and the reply's calls;
    the custom tools apart (their grammars). Hosted tools are not offered; a
    ``tool_choice`` that names one is a 400."""
    given = typed(body, "tools", (list,)) or []
    defs, customs = [], []
    for j, t in enumerate(given):
        if not isinstance(t, dict):
            raise ApiError(f"'tools[{j}]' must be a tool (an object)", f"tools[{j}]")
        kind = typed(t, "type", (str,), at=f"tools[{j}]")
        if kind in ("function", "custom"):
            if not isinstance(t.get("name"), str):
                raise ApiError(f"'tools[{j}].name' must be a string", f"tools[{j}].name")
            description = typed(t, "description", (str,), at=f"tools[{j}]") or ""
        if kind == "function":
            defs.append({"type": "function", "function": {
                "name": t["name"], "description": description,
                "parameters": tool_parameters(t.get("parameters"), f"tools[{j}].parameters")}})
        elif kind == "custom":
            custom = _custom(t, f"tools[{j}]")
            customs.append(custom)
            defs.append(custom.function(description))
    parallel = typed(body, "parallel_tool_calls", (bool,)) is not False
    choice = typed(body, "tool_choice", (str, dict)) or "auto"
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = typed(choice, "tools", (list,), at="tool_choice") or []
        allowed = {typed(t, "name", (str,), at=f"tool_choice.tools[{j}]")
                   for j, t in enumerate(listed) if isinstance(t, dict)}
        defs = [d for d in defs if d["function"]["name"] in allowed]
        customs = [c for c in customs if c.name in allowed]
        choice = "required" if choice.get("mode") == "required" else "auto"
    names = tools.schemas(defs)
    if choice == "none" or not defs:
        if choice not in ("none", "auto"):
            raise ApiError("'tool_choice' needs 'tools' this server offers (function or "
                           "custom)", "tool_choice")
        return ToolUse(), []
    last = frozenset(c.name for c in customs)
    if choice == "auto":
        return ToolUse(defs, names, parallel=parallel, last=last), customs
    if choice == "required":
        return ToolUse(defs, names, tools.START + "\n", parallel, last), customs
    name = choice.get("name") if isinstance(choice, dict) \
        and choice.get("type") in ("function", "custom") else None
    if name not in names:
        raise ApiError("'tool_choice' must be auto, none, required, allowed_tools, or a "
                       "function or custom tool among 'tools' (hosted tools are not "
                       "offered)", "tool_choice")
    return ToolUse(defs, names, f"{tools.START}\n<function={name}>\n", parallel, last), \
        customs


def _custom(tool: dict, where: str) -> tool_grammar.Custom:
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise ApiError(f"'{where}.format' must be {{\"type\": \"text\"}} or {{\"type\": "
                       f"\"grammar\", \"syntax\": \"lark\" | \"regex\", \"definition\": ...}}",
                       f"{where}.format")
    if fmt["type"] == "text":
        return tool_grammar.Custom(tool["name"], param=f"{where}.format")
    if fmt.get("syntax") not in tool_grammar.SYNTAXES or \
            not isinstance(fmt.get("definition"), str) or not fmt["definition"]:
        raise ApiError(f"'{where}.format' needs a 'syntax' (lark or regex) and a "
                       f"'definition'", f"{where}.format")
    return tool_grammar.Custom(tool["name"], fmt["syntax"], fmt["definition"],
                               f"{where}.format")


def _constraint(body: dict, use: ToolUse, customs: list) -> dict:
    """The grammar keywords: a custom tool's grammar in its calls (decode/tool_grammar.py),
    a forced call's as chat's, or ``text.format`` (json_object, json_schema)."""
    fmt = typed(typed(body, "text", (dict,)) or {}, "format", (dict,), at="text") \
        or {"type": "text"}
    kind = typed(fmt, "type", (str,), at="text.format")
    if kind == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise ApiError("'text.format.schema' must be a JSON schema (an object)",
                       "text.format.schema")
    if kind != "text" and (customs or use.prefill):
        raise ApiError(f"'text.format' and {'custom tools' if customs else 'a forced call'} "
                       f"cannot both constrain the answer", "text.format")
    if not customs:
        try:        # a grammar refusal names the field it came in
            chosen = grammar.response_format(
                {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
                if kind == "json_schema" else fmt)
        except RequestError as e:
            raise ApiError(str(e), "text.format") from None
        return {"grammar": chosen} if chosen is not None else constraint_options({}, use)
    functions = [d for d in use.tools if d["function"]["name"] not in {c.name for c in customs}]
    try:
        return {"grammar": tool_grammar.calls(functions, customs, use.prefill or None,
                                              use.parallel)}
    except RequestError as e:
        raise ApiError(str(e), e.param) from None


# ---------------------------------------------------------------------------------------------
# The reply


class ResponseReply:
    """Accumulates one generation into a response object, or into its ``response.*`` stream
    events in order (each with its ``sequence_number``): ``response.created`` and
    ``response.in_progress``; per output item ``output_item.added``, its deltas
    (``reasoning_text``, ``content_part`` and ``output_text``, ``function_call_arguments``,
    ``custom_tool_call_input``) and ``output_item.done``; then ``response.completed`` (or
    ``response.incomplete`` when ``max_output_tokens`` cut it)."""

    def __init__(self, model: str, request: ResponsesAsked, prompt_tokens: int):
        self.model, self.request, self.prompt_tokens = model, request, prompt_tokens
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.answer = Answer.of(request.use)
        self.output: list[dict] = []        # items, finished or open
        self.open: dict | None = None       # the item being streamed (reasoning or message)
        self.sequence = 0

    def add(self, chunk) -> list:
        return self.answer.add(chunk)

    # -- the response object

    def usage(self) -> dict:
        stats, a = self.answer.stats, self.answer
        cached = stats.reused_tokens if stats else 0
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": a.tokens,
                "output_tokens_details": {"reasoning_tokens": a.reasoning_tokens},
                "total_tokens": self.prompt_tokens + a.tokens}

    @property
    def cut(self) -> bool:
        stats = self.answer.stats
        return stats is not None and stats.finish_reason == "length"

    def response(self, status: str, error: dict | None = None) -> dict:
        done = status not in ("in_progress", "failed")
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": error, "model": self.model,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "output": list(self.output) if done else [],
                **self.request.echo,
                "usage": self.usage() if done else None,
                **({"dspark": self.answer.stats.as_dict()} if done and self.answer.stats
                   else {})}

    def whole(self) -> dict:
        for kind, item in self.answer_events():
            self._item(kind, item, [])
        self._close([])
        return self.response("incomplete" if self.cut else "completed")

    def answer_events(self) -> list:
        """The whole answer as events, in order (for the non-streamed response)."""
        a = self.answer
        return [("reasoning", "".join(a.reasoning))] * bool(a.reasoning) + \
            [("text", "".join(a.text))] * bool(a.text) + [("call", c) for c in a.calls]

    # -- stream events

    def start(self) -> list:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def events(self, events: list) -> list:
        out = []
        for kind, item in events:
            self._item(kind, item, out)
        return out

    def end(self) -> list:
        out = []
        self._close(out)
        status = "incomplete" if self.cut else "completed"
        return out + [self._event(f"response.{status}", response=self.response(status))]

    def failed(self, message: str) -> dict:
        return self._event("response.failed", response=self.response(
            "failed", {"code": "server_error", "message": message}))

    def _event(self, kind: str, **data) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **data}

    def _item(self, kind: str, value, out: list):
        if kind == "call":
            self._close(out)
            self._call(value, out)
            return
        want = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != want:
            self._close(out)
            self._open(want, out)
        item, at = self.open, len(self.output) - 1
        if want == "reasoning":
            item["content"][0]["text"] += value
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=at, content_index=0, delta=value))
        else:
            item["content"][0]["text"] += value
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=at, content_index=0, delta=value,
                                   logprobs=[]))

    def _open(self, kind: str, out: list):
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                    "content": [], "encrypted_content": None}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24],
                    "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item=dict(item, content=[])))
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part=dict(part)))
        item["content"].append(part)
        self.open = item

    def _close(self, out: list):
        item, self.open = self.open, None
        if item is None:
            return
        at, part = len(self.output) - 1, item["content"][0]
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=at, content_index=0, text=part["text"]))
        else:
            item["status"] = "incomplete" if self.cut else "completed"
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=at, content_index=0, text=part["text"],
                                   logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=at, content_index=0, part=dict(part)))
        out.append(self._event("response.output_item.done", output_index=at, item=item))

    def _call(self, call, out: list):
        custom = call.name in self.request.customs
        at = len(self.output)
        if custom:
            text = call.arguments.get(tool_grammar.PARAM, "")
            item = {"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex[:24],
                    "call_id": call.id, "name": call.name, "input": text,
                    "status": "completed"}
            kind, key = "custom_tool_call_input", "input"
        else:
            text = call.arguments_json
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24],
                    "call_id": call.id, "name": call.name, "arguments": text,
                    "status": "completed"}
            kind, key = "function_call_arguments", "arguments"
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=at,
                               item={**item, key: "", "status": "in_progress"}))
        out.append(self._event(f"response.{kind}.delta", item_id=item["id"], output_index=at,
                               delta=text))
        out.append(self._event(f"response.{kind}.done", item_id=item["id"], output_index=at,
                               **{key: text}, **({} if custom else {"name": call.name})))
        out.append(self._event("response.output_item.done", output_index=at, item=item))
