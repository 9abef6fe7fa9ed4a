"""Which request fields each endpoint takes (docs/serve.md, "Accepted fields").

A field is one of three kinds:

* **honoured**: the endpoint reads it and does what it asks (``HONOURED``);
* **accepted**: its meaning is informational, or a local single-user server already
  satisfies it, so any value is taken and changes nothing (``ACCEPTED``, each with the
  reason docs/serve.md gives);
* **conditional**: harmless at some values and output-changing at others (``CONDITIONAL``):
  the harmless values are accepted, any other is a 400 naming the field.

Any other field that is set (not null) is a 400 naming it, so no request is answered as if
the server had honoured something it did not. Also here: :func:`typed`, the one reader of a
typed field at any depth (a wrong type is a 400 naming its JSON path), and what an effort level
(``reasoning_effort``, ``reasoning.effort``, ``output_config.effort``) means as a thinking
budget. MLX-free, no HTTP."""

from __future__ import annotations

import json

from .errors import ApiError

SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
            "stream", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias",
            "repetition_penalty", "repetition_context_size", "min_p"}
_MESSAGES = {"model", "messages", "system", "tools", "tool_choice", "thinking",
             "output_config"}
HONOURED = {
    "chat": SAMPLING | {"messages", "max_completion_tokens", "chat_template_kwargs",
                        "reasoning_effort", "thinking_token_budget", "tools", "tool_choice",
                        "parallel_tool_calls", "logprobs", "top_logprobs", "cache_salt",
                        "response_format"},
    "completion": SAMPLING | {"prompt", "logprobs", "cache_salt", "response_format"},
    "messages": _MESSAGES | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                             "stream"},
    # count_tokens takes a message's fields; the sampling ones, when a client sends its whole
    # request, count nothing and are accepted
    "count_tokens": _MESSAGES | {"max_tokens", "stop_sequences", "temperature", "top_p",
                                 "top_k", "stream"},
    "responses": {"model", "input", "instructions", "tools", "tool_choice",
                  "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "top_k",
                  "seed", "stream", "reasoning", "text", "include", "cache_salt"},
}

_PRIVATE = "nothing leaves this machine and nothing is monitored"
ACCEPTED = {
    "metadata": "tags a provider stores with the request; this server stores nothing",
    "user": f"the end user's id, for a provider's abuse monitoring; {_PRIVATE}",
    "safety_identifier": f"the end user's id, for a provider's abuse monitoring; {_PRIVATE}",
    "store": "whether the provider keeps the response to fetch later; this server keeps no "
             "response (every request is stateless)",
    "service_tier": "a provider's capacity tier; one local engine serves every request alike",
    "prompt_cache_key": "a routing hint for a provider's prompt cache; here every request of "
                        "an API key continues from its longest cached token prefix by itself",
    "prompt_cache_retention": "how long a provider keeps cached prefixes; here they stay "
                              "while `--prefix-cache-mb` holds them",
    "client_metadata": "the client's own telemetry",
    "cache_control": "Anthropic's cache breakpoints; this server snapshots at message ends "
                     "and every 4096 tokens by itself",
    "verbosity": "a length hint OpenAI's models read; the prompt is rendered without it",
    "prediction": "predicted output speeds up a provider's decoding and never changes the "
                  "output",
    "truncation": "`auto` would drop the middle of a conversation that overflows the "
                  "context; here such a prompt is a 400, never silently cut",
    "inference_geo": "where a provider runs the model; here, on this machine",
    "stream_options": "(Responses) `include_obfuscation` pads stream events against "
                      "side channels of a remote provider; a local stream needs no padding",
}

# name -> (is this value harmless?, what the 400 says otherwise)
CONDITIONAL = {
    "frequency_penalty": (lambda v: v == 0, "must be 0 on this endpoint (chat and completions "
                                            "honour penalties)"),
    "presence_penalty": (lambda v: v == 0, "must be 0 on this endpoint (chat and completions "
                                           "honour penalties)"),
    "logit_bias": (lambda v: v == {}, "must be empty on this endpoint (chat and completions "
                                      "honour a logit bias)"),
    "modalities": (lambda v: v == ["text"], "must be [\"text\"]: this model writes text only"),
    "context_management": (
        lambda v: isinstance(v, dict) and all(
            isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking")
            for e in v.get("edits") or []),
        "only clear_thinking edits are accepted (past thinking is dropped already); other "
        "edits would change the prompt and are not supported"),
    "background": (lambda v: v is False, "must be false: this server answers in the request"),
}
_STATELESS = ("this server keeps no responses or conversations (it is stateless): send the "
              "whole conversation in 'input'")
REFUSED = {"previous_response_id": _STATELESS, "conversation": _STATELESS,
           "prompt": "stored prompt templates are not supported: send 'instructions' and "
                     "'input'"}


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          list: "an array", dict: "an object"}


def typed(obj: dict, name, kinds, check=None, what: str = "", at: str = ""):
    """``obj[name]`` if present and not null, of one of ``kinds`` (bools are not numbers),
    else a 400 naming its JSON path: ``at`` (the path of ``obj``; empty: the body) and
    ``name``. ``check``: what the value must also meet, said by ``what``."""
    where = f"{at}.{name}" if at else str(name)
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        want = "a number" if float in kinds else " or ".join(_KINDS[k] for k in kinds)
        raise ApiError(f"'{where}' must be {want}, not {json.dumps(value)[:40]}", where)
    if check is not None and not check(value):
        raise ApiError(f"'{where}' must be {what}, not {value}", where)
    return value


def check(body: dict, kind: str):
    """Refuse the first set field of ``body`` that endpoint ``kind`` neither honours nor
    accepts, or that has an output-changing value (a 400 naming it)."""
    honoured = HONOURED[kind]
    for name, value in body.items():
        if value is None:
            continue
        if kind == "responses" and name in REFUSED:
            raise ApiError(f"'{name}': {REFUSED[name]}", name, "unsupported_parameter")
        if name in CONDITIONAL and name not in honoured:
            ok, why = CONDITIONAL[name]
            if not ok(value):
                raise ApiError(f"'{name}' {why}", name, "unsupported_parameter")
            continue
        if name in honoured or name in ACCEPTED:
            continue
        raise ApiError(f"'{name}' is not supported by this server; it honours "
                       f"{', '.join(sorted(honoured))} and accepts "
                       f"{', '.join(sorted(ACCEPTED))} (docs/serve.md)", name,
                       "unsupported_parameter")


# ---------------------------------------------------------------------------------------------
# Effort levels as thinking budgets

EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                  "xhigh": None, "max": None}
"""Thinking tokens per effort level (None: no budget, thinking runs to ``max_tokens``). An
effort of ``"none"`` turns thinking off. docs/serve.md gives this table."""


def effort_budget(effort, param: str) -> tuple[bool, int | None]:
    """(thinking on?, budget) for an effort level named by ``param``."""
    if effort == "none":
        return False, None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        raise ApiError(f"'{param}' must be one of none, {', '.join(EFFORT_BUDGETS)}, not "
                       f"{json.dumps(effort)[:40]}", param)
    return True, EFFORT_BUDGETS[effort]
