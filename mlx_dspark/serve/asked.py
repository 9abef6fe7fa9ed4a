"""What one HTTP request asks, read from its body once; free of MLX and HTTP.

:class:`Defaults` is the server's values for the fields a request leaves out (made once, when
the app is), :class:`Asked` one request's prompt, the keywords its one
:class:`~mlx_dspark.request.Request` is built from (``api.make_request``'s, the defaults
merged in) and how its reply goes back, :class:`ToolUse` what its tools ask of the reply.
Each protocol's reader makes an :class:`Asked` (openai.read, anthropic.read, responses.read);
the route encodes its prompt and builds the Request (serve/routes.py), and the engine's
:class:`~mlx_dspark.serve.engine.Job` carries that Request to the loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Defaults:
    """The server's values for the fields a request leaves out (``serve --temp`` ..., else the
    model's generation_config.json, else OpenAI's: temperature 1, top_p 1, no top_k, no
    token limit), its chat template variables (``--chat-template-args``, under a request's
    own), and the engine's options, which no request sets (``--num-draft``,
    ``--speculative``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None       # None: a chat runs to the context's end
    chat_template_kwargs: dict = field(default_factory=dict)
    num_draft: int = 3
    speculative: str = "auto"

    @classmethod
    def of(cls, given: dict | None) -> "Defaults":
        """From ``create_app``'s ``defaults`` (a name left out or None keeps the default); a
        name that is no default is refused, naming it."""
        given = {k: v for k, v in (given or {}).items() if v is not None}
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a request default (the defaults are "
                             f"{', '.join(known)})")
        return cls(**given)

    def engine(self) -> dict:
        """The keywords the server sets on every request (never the request itself)."""
        return {"num_draft": self.num_draft, "speculative": self.speculative}


@dataclass
class ToolUse:
    """What a request's tools ask of the reply: the definitions for the template (None: no
    tools section), the functions to read calls of (None: no calls read), the text the
    reply is made to start with (a forced call's opening), and the functions whose call
    ends the reply (custom tools: their input runs to its closing tags, tools.Stream)."""

    tools: list | None = None
    functions: dict | None = None
    prefill: str = ""
    parallel: bool = True        # the reply may hold several calls
    last: frozenset = frozenset()


@dataclass
class Asked:
    """One request as its body asks it, whatever the protocol: the prompt (chat messages
    rendered with ``template``, or a completion's text or token ids when ``template`` is
    None), ``options``, every ``api.make_request`` keyword but the prompt and the grammar's
    (the server's defaults merged in, the stop strings a single tool call adds included;
    ``max_tokens`` None: to the end of the context), and ``constraints``, the grammar
    keywords (called off the event loop: a grammar compiles). ``where`` is the field a
    refusal of the prompt's length names; ``model`` the name the reply carries (any name:
    the one served model answers it, ``claude-*`` and ``gpt-*`` included; None: the
    server's id)."""

    where: str
    prompt: object
    options: dict
    template: dict | None = None
    use: ToolUse = field(default_factory=ToolUse)
    prefill: str = ""          # the reply's given start, written after the generation prompt
    constraints: Callable[[], dict] = dict
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
