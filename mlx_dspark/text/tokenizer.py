"""The tokenizer of a converted checkpoint: loading, prompt encoding, streaming decoding.

Loaded through mlx-lm's ``TokenizerWrapper`` (a transformers ``AutoTokenizer`` plus the
streaming detokenizer that fits its decoder), so the chat template and the eos ids come from the
checkpoint's own ``tokenizer_config.json``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..open_files import import_mlx_lm
from ..media.parts import MediaError, first_media, has_media, split, why_no_media
from ..request import RequestError
from . import reasoning
from .chat_template import render

_tokenizer_utils = import_mlx_lm("mlx_lm.tokenizer_utils")
TokenizerWrapper, _load = _tokenizer_utils.TokenizerWrapper, _tokenizer_utils.load


def load_tokenizer(path, vocab_size: int | None = None) -> TokenizerWrapper:
    """The checkpoint's tokenizer. Never runs code shipped with the checkpoint (and so never
    asks whether to); with ``vocab_size``, refuses a tokenizer whose ids reach past the
    model's vocabulary (they would index past the embedding)."""
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model",
                                              "tokenizer_config.json")):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json, tokenizer.model "
                                f"or tokenizer_config.json)")
    # transformers reads config.json too and warns that an Omni wrapper's model_type is not
    # one it knows; the tokenizer does not depend on it.
    config_log = logging.getLogger("transformers.configuration_utils")
    level = config_log.level
    config_log.setLevel(logging.ERROR)
    try:
        tokenizer = _load(path, {"trust_remote_code": False})
    except Exception as e:  # transformers raises many kinds; name the directory once
        if "trust_remote_code" in str(e):
            raise ValueError(f"{path}: the tokenizer needs code shipped with the checkpoint "
                             f"(tokenizer_config.json auto_map); mlx-dspark never runs it") from None
        raise ValueError(f"{path}: cannot load the tokenizer: {e}") from e
    finally:
        config_log.setLevel(level)
    # The loop checks prompts against the model's own context limit; the tokenizer's
    # model_max_length would only add a transformers warning on long prompts.
    tokenizer._tokenizer.model_max_length = sys.maxsize
    if vocab_size is not None:
        ids = max(tokenizer.get_vocab().values(), default=-1) + 1
        if ids > vocab_size:
            raise ValueError(f"{path}: the tokenizer has ids up to {ids - 1} but the model's "
                             f"vocab_size is {vocab_size}: a tokenizer for another model")
        bad = sorted(i for i in tokenizer.eos_token_ids if not 0 <= i < vocab_size)
        if bad:                           # stop ids: checked like any other id
            raise ValueError(f"{path}: eos_token_id {bad[0]} (generation_config.json or the "
                             f"tokenizer's) is outside the model's vocabulary [0, {vocab_size})")
    return tokenizer


def prompt_ids(tokenizer, prompt, chat: bool = False, options: dict | None = None) -> list[int]:
    """The one prompt encoder (API, CLI, chat, bench, server): token ids for a string, a list
    of chat messages (dicts with role and content), a list of token ids (kept as they are)
    or an ``mx.array`` of them. ``chat=True`` wraps a string as one user message; chat
    prompts go through the checkpoint's chat template with the generation prompt appended,
    ``options`` (template variables such as ``enable_thinking``, never tokenizer arguments)
    passed to it, its rendering bounded in time (text/chat_template.py)."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list)):
        what = f"{getattr(prompt, 'dtype', '?')} of shape {tuple(getattr(prompt, 'shape', ()))}"
        prompt = prompt.tolist()         # an mx.array or NumPy array of ids, as mlx-lm takes
        prompt = prompt if isinstance(prompt, list) else [prompt]
        if len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]           # a batch of one, [1, T]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("prompt", f"an array prompt holds token ids, one row of "
                                         f"integers; this one is {what}")
    if not prompt:
        raise RequestError("prompt", "empty prompt: give some text or at least one token id")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise RequestError("prompt", "text prompts need a tokenizer; this pair has none")
    if isinstance(prompt, str) and not chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError("this model's tokenizer has no chat template")
    return encode_chat(tokenizer, messages, options or {})[0]


def message_boundaries(tokenizer, messages: list[dict], options: dict, ids: list[int]) \
        -> list[int]:
    """Where messages end in ``ids`` (``messages`` through the chat template): the length of
    each shorter conversation's ids that ``ids`` begins with (the system prompt and tool
    definitions first). A prefix the template renders otherwise, or refuses, is no
    boundary. Only the first two and the last three message ends are looked for: each costs
    rendering and encoding the conversation so far, and the ends in between are the ends of
    earlier answers, which the prompt cache already keeps."""
    out = []
    n = len(messages)
    for i in sorted({1, 2, n - 3, n - 2, n - 1} & set(range(1, n))):
        try:
            text = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                 add_generation_prompt=False, **options)
        except Exception:       # e.g. a template that wants a user message last
            continue
        head = _encode(tokenizer, text)
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            out.append(len(head))
    return out


def template_options(tokenizer, reasoning: str | None, given: dict | None = None) -> dict:
    """Chat template variables: ``given`` (``--chat-template-args``) and, over them,
    ``--reasoning on|off`` (the ``enable_thinking`` switch)."""
    options = dict(given or {})
    if reasoning is None:
        return options
    if "enable_thinking" not in (getattr(tokenizer, "chat_template", None) or ""):
        print("note: this model's chat template has no reasoning switch; --reasoning is ignored",
              file=sys.stderr)
        return options
    return {**options, "enable_thinking": reasoning == "on"}


def encode_chat(tokenizer, messages: list[dict], options: dict) -> tuple[list[int], str]:
    """Ids and text of ``messages`` through the chat template, ready for the reply. Without
    an ``enable_thinking`` option, mlx-lm's wrapper turns thinking on when the vocabulary has
    a ``<think>`` token (Nemotron's does; the demo pair's spells it in pieces, so its chats
    think only when asked)."""
    if not has_media(messages):
        text = render(tokenizer, messages, options)
        return _encode(tokenizer, text), text
    encoder = getattr(tokenizer, "media", None)
    if encoder is None:
        raise MediaError(first_media(messages), why_no_media())
    messages, media = split(messages, encoder.allowed)
    text = render(tokenizer, messages, options)
    return encoder.expand(_encode(tokenizer, text), media), text


def _encode(tokenizer, text: str) -> list[int]:
    # templates spell out their own bos; like apply_chat_template, add no special tokens
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_ids(tokenizer, messages: list[dict], options: dict, use=None,
             prefill: str = "") -> list[int]:
    """Ids of chat messages through the template, with ``use`` (openai_api.ToolUse): its
    tools in the template's tools section; after the generation prompt, ``prefill`` (the
    reply's start as the client wrote it) and ``use.prefill`` (a forced call's opening), the
    thinking block closed first (a forced call is not thought about)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError("this model's tokenizer has no chat template")
    if use is not None and use.tools:
        options = {**options, "tools": use.tools}
    ids, text = encode_chat(tokenizer, messages, options)
    start = prefill + (use.prefill if use is not None else "")
    if not start:
        return ids
    close = reasoning.END.lstrip("\n") if reasoning.opens_thinking(text) else ""
    return ids + _encode(tokenizer, close + start)
