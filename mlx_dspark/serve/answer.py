"""A reply's chunks read into what the server APIs send (free of MLX): its thinking, its
text and its tool calls, in order, as they arrive.

The chunks already carry the thinking apart from the answer (text.stream.Chunk.reasoning); here the
answer goes through tools.Stream when the request declared tools, so that streamed events and
the whole answer hold the same calls and the same text. ``prefill`` is text the server wrote
at the start of the reply in the prompt (a forced tool call's opening), read as if the model
had written it.

A call the reply was cut off in (``max_tokens`` or the context limit) is dropped: its markup
never reaches the client as text. A request that allows one call on ``tool_choice: auto``
(``parallel_tool_calls: false``, ``disable_parallel_tool_use``) stops at the end of the first
call (:func:`one_call_stops`: the call's closing tag as a stop string, given back here)."""

from __future__ import annotations

from ..text import tools


def one_call_stops(use) -> list[str]:
    """The stop strings a request's tool use adds (``use``: openai.ToolUse): the end of a
    call when the reply may hold one call and no grammar holds it to one (a forced call's
    does, and so does a custom tool's, whose input may hold that very tag)."""
    return [tools.END] if use.functions is not None and not use.parallel \
        and not use.prefill and not use.last else []


class Answer:
    """Accumulates one reply; :meth:`add` returns its new events: ``("reasoning", str)``,
    ``("text", str)`` and ``("call", tools.Call)``."""

    def __init__(self, functions: dict | None = None, prefill: str = "",
                 one_call: bool = False, last=frozenset()):
        self.stream = tools.Stream(functions, last) if functions is not None else None
        self.one_call = one_call
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[tools.Call] = []
        self.tokens = 0               # answer tokens (a final stop token is not one)
        self.reasoning_tokens = 0     # of which inside the thinking block
        self.stats = None
        self.held = self._read(prefill) if prefill else []

    @classmethod
    def of(cls, use) -> "Answer":
        """The answer to a request with tool use ``use`` (openai.ToolUse)."""
        return cls(use.functions, use.prefill, bool(one_call_stops(use)), use.last)

    def ours(self, chunk) -> bool:
        """Whether the stop string that ended ``chunk`` is the one :func:`one_call_stops`
        added (the client did not ask for it)."""
        return self.one_call and chunk.stop_string == tools.END

    def add(self, chunk) -> list[tuple[str, object]]:
        self.tokens += not chunk.stop
        self.reasoning_tokens += chunk.thinking and not chunk.stop
        self.stats = chunk.stats
        events = []
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
            events.append(("reasoning", chunk.reasoning))
        text = chunk.text + (tools.END if self.ours(chunk) else "")
        events += self.held + self._read(text)
        self.held = []
        if chunk.finish_reason is not None and self.stream is not None:
            events += self._pieces(self.stream.finish(cut=chunk.finish_reason == "length"))
        return events

    def _read(self, text: str) -> list:
        if self.stream is None:
            return self._pieces([text] if text else [])
        return self._pieces(self.stream.add(text))

    def _pieces(self, pieces) -> list:
        out = []
        for p in pieces:
            if isinstance(p, tools.Call):
                self.calls.append(p)
                out.append(("call", p))
            elif p:
                self.text.append(p)
                out.append(("text", p))
        return out

    @property
    def finish_reason(self) -> str:
        """"tool_calls" when the reply called tools and was not cut short, else "stop" or
        "length"."""
        if self.stats.finish_reason == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"
