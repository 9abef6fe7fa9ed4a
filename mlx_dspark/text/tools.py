"""Tool calls in Nemotron's format, read out of a reply (free of MLX).

Nemotron calls a tool by writing, after its thinking::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

one block per call. :func:`parse` finds the blocks of a whole answer and :class:`Stream` the
same blocks in streamed text; both give the same calls and the same remaining text. A call's
arguments become a JSON object typed by the function's JSON schema (an ``integer`` parameter
``3`` is the number 3, an ``object`` is parsed as JSON). A block that is not a well-formed call
of a declared function with values of the declared types is left in the text, as written: a
wrong call reaches the client as text, never as an error.

A call to one of the ``last`` functions (the Responses API's custom tools) ends the reply: its
one parameter is everything from its opening to the closing tags the answer ends with, markup
included, since a tool's own grammar may write ``</parameter>`` or ``<tool_call>`` in it
(decode/tool_grammar.py holds such a call to the reply's end)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .reasoning import partial_tag

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)
_HEAD = re.compile(r"\s*<function=([^>\n]+)>\n")
_LAST = re.compile(r"\s*<function=([^>\n]+)>\n<parameter=([^>\n]+)>\n(.*)\n</parameter>\n"
                   r"</function>\n" + END + r"\s*", re.S)


class WrongCall(ValueError):
    """A block that is not a valid call (the reason, for logs and tests)."""


@dataclass
class Call:
    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


def schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema, from OpenAI-style ``tools``."""
    out = {}
    for tool in tools or []:
        f = tool.get("function", tool)
        out[f["name"]] = f.get("parameters") or {}
    return out


def read_call(block: str, functions: dict[str, dict]) -> Call:
    """The call written between ``<tool_call>`` and ``</tool_call>``; :class:`WrongCall` when
    it is not a well-formed call of one of ``functions`` (name -> parameters schema)."""
    m = _BLOCK.fullmatch(block)
    if m is None:
        raise WrongCall("not a <function=NAME>...</function> block")
    name, body = m.group(1).strip(), m.group(2)
    if name not in functions:
        raise WrongCall(f"no function named {name!r}")
    schema = functions[name]
    props = schema.get("properties") or {}
    args, at = {}, 0
    for p in _PARAM.finditer(body):
        if body[at:p.start()].strip():
            raise WrongCall(f"text between parameters: {body[at:p.start()]!r}")
        key = p.group(1).strip()
        if key in args:
            raise WrongCall(f"parameter {key!r} given twice")
        args[key] = typed(p.group(2), props.get(key), key)
        at = p.end()
    if body[at:].strip():
        raise WrongCall(f"text after the parameters: {body[at:]!r}")
    if props and schema.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            raise WrongCall(f"undeclared parameters {extra}")
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        raise WrongCall(f"missing required parameters {missing}")
    return Call(name, args)


def typed(text: str, spec: dict | None, key: str = ""):
    """A parameter's text as the value its schema declares: a string stays as written; a
    parameter without a declared type is JSON when it parses, else the string."""
    kinds = (spec or {}).get("type") or []
    kinds = kinds if isinstance(kinds, list) else [kinds]
    others = [k for k in kinds if k != "string"]
    if kinds and not others:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = _NOT_JSON
    if value is not _NOT_JSON and (not kinds or any(_is(value, k) for k in others)):
        return value
    if not kinds or "string" in kinds:
        return text
    raise WrongCall(f"parameter {key!r}: {text!r} is not {' or '.join(kinds)}")


_NOT_JSON = object()


def _is(value, kind: str) -> bool:
    return {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
            "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
            "string": lambda v: isinstance(v, str)}.get(kind, lambda v: True)(value)


def parse(text: str, functions: dict[str, dict]) -> tuple[str, list[Call]]:
    """``(text, calls)`` of a whole answer: the valid calls, and the text around them (what
    is next to a call loses its whitespace on that side; a wrong block stays as written)."""
    s = Stream(functions)
    pieces = s.add(text) + s.finish()
    return "".join(p for p in pieces if isinstance(p, str)), \
        [p for p in pieces if isinstance(p, Call)]


class Stream:
    """Streamed answer text -> pieces in order: text (str) and calls (:class:`Call`). Holds
    back what could still be the start of ``<tool_call>``, a block until its
    ``</tool_call>`` (a call to one of the ``last`` functions until the answer ends), and
    whitespace that a following call would drop."""

    def __init__(self, functions: dict[str, dict], last=frozenset()):
        self.functions, self.last = functions, last
        self.to_end = False       # the open block is a call to one of ``last``
        self.buffer = ""        # text not yet given out
        self.in_call = False
        self.gap = ""             # whitespace before the open block (kept if it is no call)
        self.after_call = False   # the next text follows a call: its leading space goes

    def add(self, text: str) -> list:
        self.buffer += text
        out = []
        while True:
            if self.in_call:
                head = _HEAD.match(self.buffer)
                self.to_end = self.to_end or head is not None and head.group(1) in self.last
                if self.to_end:
                    return [p for p in out if p]
                at = self.buffer.find(END)
                if at < 0:
                    return [p for p in out if p]
                block, self.buffer = self.buffer[:at], self.buffer[at + len(END):]
                self.in_call = False
                try:
                    out.append(read_call(block, self.functions))
                    self.after_call = True
                except WrongCall:
                    out.append(self._text(self.gap + START + block + END))
                continue
            at = self.buffer.find(START)
            if at >= 0:
                before, self.buffer = self.buffer[:at], self.buffer[at + len(START):]
                shown = before.rstrip()
                out.append(self._text(shown))
                self.gap, self.in_call = before[len(shown):], True
                continue
            # hold back a possible start of a block, and trailing whitespace
            keep = partial_tag(self.buffer, START)
            ready = self.buffer[:len(self.buffer) - keep]
            shown = ready.rstrip()
            out.append(self._text(shown))
            self.buffer = ready[len(shown):] + self.buffer[len(ready):]
            return [p for p in out if p]

    def finish(self, cut: bool = False) -> list:
        """The rest at the end of the answer: an unfinished block is text, unless the answer
        was ``cut`` off (by a token limit): then the block it was cut in, or the start of
        one, is dropped, never shown as text."""
        last = _LAST.fullmatch(self.buffer) if self.to_end and not cut else None
        if last is not None and last.group(1) in self.last:
            self.buffer, self.in_call, self.to_end = "", False, False
            return [Call(last.group(1), {last.group(2): last.group(3)})]
        if cut:
            rest = "" if self.in_call else \
                self.buffer[:len(self.buffer) - partial_tag(self.buffer, START)]
        else:
            rest = (self.gap + START if self.in_call else "") + self.buffer
        self.buffer, self.in_call, self.to_end = "", False, False
        text = self._text(rest)
        return [text] if text else []

    def _text(self, text: str) -> str:
        if self.after_call and text:
            text = text.lstrip()
            self.after_call = not text
        return text
