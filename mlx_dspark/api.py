"""The public API (ARCHITECTURE.md): ``load``, ``generate``, ``stream_generate``.

``generate`` is ``stream_generate`` collected, so streaming yields exactly the text the
non-streaming call returns. Both build one :class:`~mlx_dspark.request.Request` from their
keywords and hand it, with a session, to :func:`stream`, which the CLI and the server call
with requests of their own."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Iterator

from .decode.session import Session
from .decode.warm import warm_up  # noqa: F401 (public: load(warm=True), the CLI)
from .loading import (DEMO, Pair, check_sources, drafter_note,  # noqa: F401 (public names)
                      kernel_cache_cold, load, load_another_drafter)
from .models.media_rows import text_ids
from .request import Request, RequestError, split_stops
from .stats import Stats, format_stats
from .text import reasoning
from .text.chat_template import check_template_variables
from .text.stream import Chunk, chunks  # noqa: F401 (public: md.Chunk)
from .text.tokenizer import message_boundaries, prompt_ids


@dataclass
class Result:
    """``text``: the answer; ``reasoning``: the thinking (empty when the prompt opened no
    thinking block); ``tokens``: every generated token (thinking included, stop token not)."""

    text: str
    tokens: list[int]
    stats: Stats
    reasoning: str = ""

    @property
    def finish_reason(self):
        return self.stats.finish_reason

    finish_detail = property(lambda self: self.stats.finish_detail)


def make_request(pair: Pair, prompt, max_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 num_draft: int | str = 3, speculative="auto", stop=None, chat: bool = False,
                 chat_template_kwargs: dict | None = None, sampling: str | None = None,
                 thinking_token_budget: int | None = None, response_format: dict | None = None,
                 grammar=None, logprobs: int | None = None,
                 split_thinking: bool = True, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, repetition_penalty: float | None = None,
                 repetition_context_size: int = 20, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, logit_bias: dict | None = None,
                 logits_processors=(), sampler=None) -> Request:
    """The :class:`Request` that ``stream_generate``'s keywords describe (the prompt encoded,
    the tokenizer's eos ids among the stop tokens, the grammar bound to the tokenizer, ids
    the tokenizer cannot decode never drawn). ``split_thinking=False``: a prompt that opens
    a thinking block is not read as one; the reply comes back as the model writes it, its
    thinking and closing tag in ``text`` (the server's ``/v1/completions``)."""
    strings, ids = split_stops(stop)
    for name, value in (("chat", chat), ("split_thinking", split_thinking)):
        if not isinstance(value, bool):
            raise RequestError(name, f"{name} must be True or False, not {value!r}")
    if chat_template_kwargs is not None:
        check_template_variables(chat_template_kwargs)
    if strings and pair.tokenizer is None:
        raise RequestError("stop", "stop strings need a tokenizer")
    prompt = prompt_ids(pair.tokenizer, prompt, chat, chat_template_kwargs)
    text = text_ids(pair.target, prompt)        # media positions as their placeholder tokens
    return Request(prompt, max_tokens=256 if max_tokens is None else max_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k,
                   sampling=sampling, num_draft=num_draft, speculative=speculative, seed=seed,
                   stop_tokens=ids | pair.stop_tokens(), stop_strings=strings,
                   thinking=reasoning.thinking_of(pair.tokenizer, text) if split_thinking else None,
                   thinking_token_budget=thinking_token_budget, logprobs=logprobs,
                   vocab_limit=pair.decodable,
                   grammar=constraint_of(pair, text, response_format, grammar),
                   min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                   repetition_penalty=repetition_penalty,
                   repetition_context_size=repetition_context_size,
                   presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                   logit_bias=logit_bias, logits_processors=logits_processors, sampler=sampler,
                   after_thinking=split_thinking and reasoning.after_thinking(pair.tokenizer, text))


def constraint_of(pair: Pair, prompt: list[int], response_format, grammar):
    """The grammar that ``response_format=`` (OpenAI's shape) or ``grammar=`` (a
    grammar.Grammar or a JSON schema dict) asks for, bound to the pair's tokenizer; after the
    thinking block when the prompt opens one (the reasoning stays free)."""
    if response_format is None and grammar is None:
        return None
    from .grammar import grammars
    if response_format is not None and grammar is not None:
        raise RequestError("grammar", "give response_format or grammar, not both")
    chosen = grammars.response_format(response_format) if response_format is not None \
        else grammars.of(grammar)
    if chosen is None:
        return None
    if reasoning.thinking_of(pair.tokenizer, prompt) is not None:
        chosen = chosen.after_thinking()
    return chosen.bind(pair.tokenizer, pair.target.config.vocab_size)


# mlx-lm's keywords (and the draft model's), and how they are spelled here.
MLX_LM_KEYWORDS = {
    "temp": "temperature=", "draft_model": "md.load(model, drafter)",
    "num_draft_tokens": "num_draft=",
    "prompt_cache": "session=pair.session()", "formatter": "stream_generate()",
    "prompt_progress_callback": "progress=, called with (done, total, seconds)",
}


def _check_call(function: str, pair, prompt, options: dict):
    """mlx-lm's call shapes refused in one line that shows this package's."""
    if not isinstance(pair, Pair):
        raise TypeError(f"{function}(pair, prompt, ...): the first argument is the Pair "
                        f"md.load() returns, not {type(pair).__name__}")
    if hasattr(prompt, "encode") and not isinstance(prompt, (str, bytes)):
        raise TypeError(f"{function}(pair, prompt, ...) takes no tokenizer (the pair holds it): "
                        f"mlx-lm's {function}(model, tokenizer, prompt) is "
                        f"md.{function}(pair, prompt) here")
    known = set(inspect.signature(make_request).parameters) - {"pair", "prompt", "max_tokens"}
    for name in options:
        if name not in known:
            hint = MLX_LM_KEYWORDS.get(name)
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}"
                            + (f" (mlx-lm's {name}; here: {hint})" if hint else ""))


def stream_generate(pair: Pair, prompt, max_tokens: int | None = None, *,
                    session: Session | None = None, progress=None,
                    **options) -> Iterator[Chunk]:
    """Yield one chunk per generated token; the last one carries the finish reason.
    ``max_tokens``: most tokens to generate (default 256).

    ``prompt``: a str (encoded with the tokenizer; ``chat=True`` applies the chat template), a
    list of chat messages, a list of token ids used verbatim (or an integer ``mx.array`` /
    NumPy array of them, ``[T]`` or ``[1, T]``; a float one is a RequestError), or a
    :class:`Request` (then no other option is taken). Options (:func:`make_request`):
    ``temperature`` (finite, >= 0), ``top_p`` ([0, 1]), ``top_k`` (>= 0), ``seed`` (an
    integer in [0, 2**64), as the server takes it), ``num_draft`` (an int, or "auto": each
    round's length chosen);
    ``speculative``: "auto", True/"on" or False/"off";
    ``stop``: extra stop token ids (ints) and/or stop strings (the tokenizer's eos ids always
    stop; a stop token is not part of the output; a stop string ends the text just before it,
    the token that completed it kept in ``tokens``; under a grammar it cuts nothing and ends
    the answer where it is first complete); ``chat_template_kwargs`` (such as
    ``{"enable_thinking": False}``) go to the chat template. A prompt that leaves a thinking
    block open (``<think>``) gets its thinking in ``chunk.reasoning`` and its answer in
    ``chunk.text``; in a chat whose template opened or closed a thinking block, a ``<think>``
    or ``</think>`` the model writes outside an open block never reaches ``chunk.text`` (one
    before any answer opens a block, others are dropped);
    ``thinking_token_budget``: most thinking tokens before the engine closes the block itself
    and the model answers; ``split_thinking=False`` leaves the thinking and every tag in
    ``chunk.text``, as the model wrote it.

    ``response_format`` (OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"schema": ...}}``) or ``grammar`` (a :mod:`mlx_dspark.grammar.grammars` Grammar,
    such as ``grammar.tool_calls(tools)``, or a JSON schema dict) constrain the output: every
    token follows the grammar, in serial and speculative decoding alike (docs/grammar.md).

    ``sampling``: "rejection" (more drafts accepted) or "reproducible" (a ``seed`` gives the
    same tokens whether or not and however the drafter speculates); both sample exactly the
    warped target (docs/sampling.md). The default is "reproducible" when a ``seed`` is given,
    else "rejection". Greedy decoding is the same in both. The seed used, given or drawn, is
    ``stats.seed``.

    mlx-lm's knobs, exact under speculation (docs/sampling.md, "Penalties and processors"):
    ``min_p`` ([0, 1], with ``min_tokens_to_keep``), ``repetition_penalty`` ([0.001, 1000];
    1 = off) over the last ``repetition_context_size`` tokens (20; prompt included),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2], over the generated
    tokens), ``logit_bias`` ({id: finite bias}, added to the logits), ``logits_processors`` (a
    list of ``(tokens, logits) -> logits``, applied to every row, the drafter's and the
    target's, with the tokens before it) and ``sampler`` (``logprobs -> token``, instead of
    the temperature, top-p, top-k, min-p and seed; drafts are kept while they equal its
    token). Logits that one of these leaves with a NaN, a +inf or no token above -inf end the
    run with a RequestError naming it, as does a sampler's id outside the vocabulary.

    ``logprobs``: score each token under the target's own distribution with this many top
    alternatives (0..20), read off the rows the generation computed; the last chunk's
    ``stats.logprobs`` holds ``(token, logprob, [(id, logprob), ...])`` per token.

    ``session`` (``pair.session()``) keeps the state for a next call that extends this one.

    ``progress(done, total, seconds)`` (mlx-lm's ``prompt_progress_callback``, with the time):
    called as the prefill starts (``done``: the prompt tokens already held, reused) and after
    each piece of it (about 512 tokens), with the prompt tokens in the cache, the prompt's
    length and the seconds since the prefill started. An exception it raises stops the prefill
    there and comes out of the iteration (a way to cancel a long prompt)."""
    _check_call("stream_generate", pair, prompt, options)
    return _stream_generate(pair, prompt, max_tokens, session, options, progress)


def _stream_generate(pair, prompt, max_tokens, session, options,
                     progress=None) -> Iterator[Chunk]:
    messages = prompt if isinstance(prompt, list) and prompt \
        and all(isinstance(m, dict) for m in prompt) else None
    if session is not None and messages is not None:
        prompt = messages = session.continued(messages)
    if isinstance(prompt, Request):
        given = [*options] + (["max_tokens"] if max_tokens is not None else [])
        if given:
            raise TypeError(f"a Request carries every option; got {', '.join(given)} too")
        request = prompt
        if request.vocab_limit is None and pair.decodable is not None:   # made without the
            request = dataclasses.replace(request, vocab_limit=pair.decodable)   # pair
    else:
        request = make_request(pair, prompt, max_tokens, **options)
    boundaries = ()
    if session is None and pair.prompt_cache is not None and messages is not None:
        boundaries = message_boundaries(pair.tokenizer, prompt,
                                        options.get("chat_template_kwargs") or {},
                                        list(request.prompt))
    chunks = stream(pair, request, session, boundaries, progress)
    return chunks if session is None else _holding(chunks, session, messages, session.generation)


def _holding(chunks: Iterator[Chunk], session: Session, messages, mine: int) -> Iterator[Chunk]:
    """``chunks``; then the session holds ``messages`` and the answer (none after text or ids;
    unchanged when a call after this, the ``mine``-th, took the session over)."""
    text = []
    try:
        for chunk in chunks:
            text.append(chunk.text)
            yield chunk
    finally:
        chunks.close()
        if session.generation == mine:
            session.messages = [] if messages is None else \
                messages + [{"role": "assistant", "content": "".join(text)}]


def stream(pair: Pair, request: Request, session: Session | None = None,
           boundaries=(), progress=None) -> Iterator[Chunk]:
    """The chunks of ``request`` (as :func:`make_request` built it for ``pair``) decoded on
    ``session`` (None: a session of its own, without the drafter when the request never
    speculates, or continued from the pair's prompt cache when it has one; ``boundaries``:
    where the prompt's chat messages end, checkpoints; ``progress``: the prefill's callback,
    as :func:`stream_generate` has it). The request is decoded as it is."""
    from .decode.batch import decode

    if session is None and pair.prompt_cache is not None:
        return _cached(pair, request, boundaries, progress)
    if session is None:
        session = Session(pair.target, pair.drafter if request.speculative != "off" else None,
                          home=pair)
    stats = Stats()
    return chunks(pair, request, decode(session, request, stats, progress), stats)


def _cached(pair: Pair, request: Request, boundaries, progress) -> Iterator[Chunk]:
    """``stream`` on a session continued from the pair's prompt cache; the states after the
    prompt and after the answer are remembered for later calls."""
    session = Session(pair.target, pair.drafter, home=pair)   # one kind of snapshot
    return pair.prompt_cache.through(session,
                                     lambda s: stream(pair, request, s, progress=progress),
                                     request.prompt, boundaries)


def generate(pair: Pair, prompt, max_tokens: int | None = None, *,
             session: Session | None = None, verbose: bool = False, progress=None,
             **options) -> Result:
    """Generate and return the whole result (same arguments as ``stream_generate``, the
    ``progress`` callback included). ``verbose=True`` (mlx-lm's) also prints the text as it
    comes and then the stats."""
    _check_call("generate", pair, prompt, options)
    text, thought, tokens, stats = [], [], [], None
    for chunk in _stream_generate(pair, prompt, max_tokens, session, options, progress):
        text.append(chunk.text)
        thought.append(chunk.reasoning)
        if verbose:
            print(chunk.text, end="", flush=True)
        if not chunk.stop:
            tokens.append(chunk.token)
        stats = chunk.stats
    if verbose:
        print("\n".join(["", "=========="] + format_stats(stats)), flush=True)
    return Result("".join(text), tokens, stats, "".join(thought))
