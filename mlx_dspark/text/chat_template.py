"""Rendering a checkpoint's chat template for a request: which variables a caller may set,
and a time bound on the rendering.

The template is the model's: a request sets template *variables* (``enable_thinking``), never
the template itself nor an argument of the tokenizer's ``apply_chat_template`` (``tokenize``,
``add_generation_prompt``, ``chat_template``…), as vLLM and SGLang decided. Jinja's sandbox
stops escapes, not work: a loop bounded by a variable can run for hours, so rendering runs on
a worker thread that is interrupted once it has had its time."""

from __future__ import annotations

import ctypes
import inspect
import json
import re
import threading

from ..request import RequestError

RENDER_SECONDS = 10.0       # a template over the largest request renders in well under 1 s

# apply_chat_template's own parameters (what a variable of that name would override), and the
# names the rendering itself passes.
_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens", "processor_kwargs"})


def _apply_parameters() -> frozenset:
    from transformers import PreTrainedTokenizerBase
    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(n for n, p in params.items()
                     if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD)


# Variables that switch a part of a template on or off (enable_thinking, thinking,
# truncate_history_thinking...): templates test them for truth, so "false", 1 or {} would
# switch thinking on. Only true and false are taken.
_SWITCH = re.compile(r"enable_\w+|(\w+_)?thinking")


class TemplateTimeout(Exception):
    """Raised inside the rendering thread, and to the caller, when time is up."""


def check_template_variables(variables) -> dict:
    """``chat_template_kwargs`` as template variables: an object with string keys, none of
    them a tokenizer argument or the template itself, its switches booleans."""
    if not isinstance(variables, dict) or not all(isinstance(k, str) for k in variables):
        raise RequestError("chat_template_kwargs", "chat_template_kwargs must be an object of "
                                                   "template variables (string keys)")
    reserved = sorted(set(variables) & (_RESERVED | _apply_parameters()))
    if reserved:
        what = ("a request cannot bring its own chat template; the model's is used"
                if "chat_template" in reserved else
                "these are arguments of the tokenizer, not template variables")
        raise RequestError("chat_template_kwargs", f"chat_template_kwargs may not set "
                                                   f"{', '.join(reserved)}: {what}")
    for name, value in variables.items():
        if _SWITCH.fullmatch(name) and not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{name}",
                               f"chat_template_kwargs.{name} is a switch: true or false, not "
                               f"{json.dumps(value, default=repr)[:40]}")
    return variables


def render(tokenizer, messages: list[dict], options: dict,
           seconds: float = RENDER_SECONDS) -> str:
    """The chat template applied to ``messages`` with the generation prompt appended, on a
    worker thread given ``seconds``; past them the thread is interrupted (at its next Python
    instruction) and :class:`TemplateTimeout` raised here. ``options``: template variables
    (a caller's, passed through :func:`check_template_variables` first) and the engine's own
    arguments (``tools``)."""
    done: dict = {}

    def work():
        try:
            done["text"] = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **options)
        except BaseException as e:      # handed to the caller below
            done["error"] = e

    worker = threading.Thread(target=work, name="mlx-dspark-template", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                   ctypes.py_object(TemplateTimeout))
        worker.join(1.0)
        raise TemplateTimeout(f"the chat template did not finish rendering within "
                              f"{seconds:g} s")
    if "error" in done:
        raise done["error"]
    return done["text"]
