"""Grammars of agents' tool calls beyond :func:`grammar.tool_calls`: calls whose input is held
to the tool's own grammar (OpenAI's ``custom`` tools with a Lark or regex ``format``, as
Codex sends its ``apply_patch``), in a reply that is free text with the calls at its end
(``tool_choice: "auto"``) or that starts with a call (a forced ``tool_choice``).

A custom tool is shown to the model as a function with one string parameter, ``input``
(:data:`PARAM`); the model calls it in Nemotron's format and the text between
``<parameter=input>`` and ``</parameter>`` is the raw input. Each tool's grammar keeps its own
rule names: it is a separate grammar in llguidance's top-level list, referenced as ``@gN``
from the calls' grammar (:class:`Nested`). The result is a :class:`grammar.Grammar` like any
other: it rides on the request, composes with the thinking block and with speculation.

A tool's grammar may write the calls' own markup (``</parameter>``, ``</tool_call>``,
``<tool_call>\n<function=other>``: an ``apply_patch`` line can hold any text), so no reader
could tell where such an input ends if another call could follow it. A custom call is
therefore the reply's last: the grammar allows nothing after it, and the reader
(text/tools.Stream, ``last``) takes its input as everything up to the closing tags the reply
ends with, exactly what the tool's grammar produced."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..request import RequestError
from . import grammars as grammar
from . import limits
from .grammars import Grammar

PARAM = "input"
SYNTAXES = ("lark", "regex")


@dataclass(frozen=True)
class Custom:
    """A custom tool: its name, its input's grammar (``syntax`` "lark" or "regex" and the
    ``definition``; no syntax: free text) and the request field it came from (errors)."""

    name: str
    syntax: str | None = None
    definition: str = ""
    param: str = "tools"

    def lark(self) -> str | None:
        """The input's grammar as a Lark grammar (None: free text)."""
        if self.syntax == "lark":
            return self.definition
        if self.syntax == "regex":
            return "start: /" + self.definition.replace("/", "\\/") + "/\n"
        return None

    def function(self, description: str = "") -> dict:
        """The function the chat template shows the model for this tool."""
        how = f"raw text (not JSON) in this {self.syntax} grammar:\n{self.definition}" \
            if self.syntax else "raw text (not JSON)"
        return {"type": "function", "function": {
            "name": self.name, "description": description,
            "parameters": {"type": "object", "required": [PARAM], "properties": {
                PARAM: {"type": "string", "description": f"The tool's input: {how}"}}}}}


class Nested(Grammar):
    """A grammar in llguidance's top-level JSON form: the calls' Lark grammar first, the
    custom tools' grammars after it (named ``g0``, ``g1``, ...)."""

    def after_thinking(self) -> "Nested":
        top = json.loads(self.source)
        main = Grammar(top["grammars"][0]["lark_grammar"], self.label,
                       self.param).after_thinking()
        top["grammars"][0]["lark_grammar"] = main.source
        return replace(self, source=json.dumps(top), label=main.label, vocabulary=None,
                       compiled=None)


def calls(functions: list[dict], customs: list[Custom], prefix: str | None = None,
          parallel: bool = True) -> Grammar:
    """Calls of ``functions`` (OpenAI's ``{"type": "function", "function": {...}}``,
    arguments typed by their schemas as in grammar.tool_calls) and of ``customs`` (input
    held to each one's grammar). ``prefix`` None: free text, then (optionally) calls; else
    the reply's first call starts with ``prefix`` (already in the prompt) and the output is
    the rest, the calls only. ``parallel``: more than one call (a custom call is always the
    last). A function's arguments are
    typed by its schema in a forced reply; after free text they are only held to end where
    the call ends (read, and a wrong call left as text, as without a grammar)."""
    rules, subs = [], []
    firsts = {"f": [], "c": []}   # a function's call may be followed; a custom's ends it all
    tools = [("f", f.get("function", f)) for f in functions] + [("c", c) for c in customs]
    typed = [grammar._parameters(t, "tools") if k == "f" and prefix is not None else None
             for k, t in tools]
    count = sum(len(t[0]) for t in typed if t)
    if count > limits.MAX_TOOL_PARAMETERS:
        raise RequestError("tools", f"the tools have {count} parameters, more than the limit "
                                    f"of {limits.MAX_TOOL_PARAMETERS} for a forced tool call")
    for i, (kind, tool) in enumerate(tools):
        name = tool["name"] if kind == "f" else tool.name
        if not grammar._NAME.match(name):
            raise RequestError(tool.param if kind == "c" else "tools",
                               f"tool name {name!r}: use letters, digits, _ . : -")
        opening = f"<tool_call>\n<function={name}>\n"
        rules.append(f"f{i}: {json.dumps(opening)} b{i}")
        if typed[i]:
            rules += grammar._body_rules(i, name, *typed[i], "tools")
        elif kind == "f":
            rules.append(f"b{i}[lazy]: /(?s:.*)<\\/function>\\n<\\/tool_call>/")
        else:
            rules += _custom_body(i, tool, subs)
        start = "<tool_call>" if prefix is None else prefix
        if opening.startswith(start):
            rest = opening[len(start):]
            firsts[kind].append(f"{json.dumps(rest)} b{i}" if rest else f"b{i}")
    if not firsts["f"] + firsts["c"]:
        raise RequestError("tool_choice", f"no tool call starts with {prefix!r}")
    ended = [f"f{i}" for i, (kind, _) in enumerate(tools) if kind == "f"]
    lasts = [f"f{i}" for i, (kind, _) in enumerate(tools) if kind == "c"]
    more = "".join([' ("\\n" call)*'] * bool(ended) + [' ("\\n" last)?'] * bool(lasts)) \
        if parallel else ""
    alts = [f"({' | '.join(firsts['f'])}){more}"] * bool(firsts["f"]) + firsts["c"]
    head = "start: TEXT | head first" if prefix is None else "start: first"
    text = "\n".join([
        head, *(["TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
                 "head[lazy]: /(?s:.*)<tool_call>/"] if prefix is None else []),
        f"first: {' | '.join(alts)}", *([f"call: {' | '.join(ended)}"] if ended else []),
        *([f"last: {' | '.join(lasts)}"] if lasts else []), *rules])
    label = f"tool calls to {', '.join(t['name'] if k == 'f' else t.name for k, t in tools)}"
    top = {"grammars": [{"lark_grammar": text}] +
           [{"name": f"g{j}", "lark_grammar": sub} for j, sub in enumerate(subs)]}
    return _checked(Nested(json.dumps(top), label, "tools"))


def _custom_body(i: int, tool: Custom, subs: list) -> list[str]:
    """Rule ``b{i}``: a custom call's input and its closing tags; its grammar joins
    ``subs``."""
    close = json.dumps("</function>\n</tool_call>")
    head = json.dumps(f"<parameter={PARAM}>\n")
    lark = tool.lark()
    if lark is None:        # free text, up to the first end of the parameter
        return [f"b{i}: {head} c{i} {close}", f"c{i}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/"]
    _checked(Grammar(lark, f"the {tool.syntax} grammar of {tool.name}", tool.param))
    subs.append(lark)
    return [f"b{i}: {head} @g{len(subs) - 1} {json.dumps(chr(10) + '</parameter>' + chr(10))} "
            f"{close}"]


def _checked(g: Grammar) -> Grammar:
    """``g``, once llguidance validates it (in a compiler, grammar_limits.compiled)."""
    g._compile(grammar._validated, g.source)
    return g
