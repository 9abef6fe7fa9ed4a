"""What one generation asks for, as one value checked once (this module imports no MLX).

A :class:`Request` is made by the API, the CLI and the server alike, at their edge (keywords,
flags, an HTTP body), and handed as it is to ``decode(session, request)`` (decode/loop.py);
nothing else carries options. Each refusal is a :class:`RequestError` naming the parameter
(``.param``, the API's keyword), which the CLI turns into its flag through :data:`FLAGS` and
the server into its JSON field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

MODES = ("auto", "on", "off")
SCHEMES = ("reproducible", "rejection")
# The default without a seed: rejection sampling, because the coupled scheme accepted 20 %
# fewer tokens per round at T = 1, top-p 0.95 on the demo pair, beyond the 10 % it was allowed
# to cost (docs/sampling.md has the table and the command). With a seed the default is
# "reproducible": a seed then means the same text in every mode, whatever "auto" decides.
DEFAULT_SCHEME = "rejection"
SEEDED_SCHEME = "reproducible"
SEEDS = 1 << 64
MAX_DRAFT = 64      # no drafter proposes more per round; bounds what a request can allocate
AUTO_DRAFT = "auto"    # num_draft: each round's length chosen by the controller (decode/length.py)
MAX_LOGPROBS = 20      # alternatives per token a request may ask for (OpenAI's top_logprobs bound)
# repetition_penalty's range: past a factor of 1000 either way a penalty changes nothing a
# user could want (a seen token's logit already cut to about 0 or scaled a thousandfold), and
# one of 1e-38 overflows float32 logits to inf.
REPETITION_PENALTY = (1e-3, 1e3)

# The API keyword -> the CLI flag that sets it (commands print refusals with the flag).
FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p",
    "top_k": "--top-k", "sampling": "--sampling", "num_draft": "--num-draft",
    "speculative": "--speculative", "seed": "--seed", "stop": "--stop",
    "thinking_token_budget": "--thinking-token-budget", "min_p": "--min-p",
    "min_tokens_to_keep": "--min-tokens-to-keep", "repetition_penalty": "--repetition-penalty",
    "repetition_context_size": "--repetition-context-size",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
}

# The spellings ``speculative=`` takes (the CLI's words and the booleans), in one vocabulary.
_MODE_OF = {"auto": "auto", "on": "on", "off": "off", True: "on", False: "off"}


@dataclass(frozen=True)
class Thinking:
    """A reply that starts inside a thinking block (its prompt opened one): ``close``, the ids
    of the closing tag (the model closed the block itself when they appear); ``end``, the ids
    the engine feeds to close it when ``thinking_token_budget`` runs out."""

    close: tuple[int, ...]
    end: tuple[int, ...]


class RequestError(ValueError):
    """A parameter outside its meaning; ``param`` names it (an API keyword)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class NonFiniteLogits(ArithmeticError):
    """A generation whose model state stopped being finite (inf or NaN logits): ended with
    this error instead of emitting token 0 forever."""


def speculative_mode(value) -> str:
    """``"auto"``, ``"on"`` or ``"off"`` from any spelling the API takes."""
    if isinstance(value, (str, bool)) and value in _MODE_OF:
        return _MODE_OF[value]
    raise RequestError("speculative", f"speculative must be 'auto', 'on', 'off', True or "
                                      f"False, not {value!r}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling(temperature, top_p, top_k, sampling: str = DEFAULT_SCHEME,
                   min_p=0.0, min_tokens_to_keep=1):
    """Refuse sampling parameters outside their meaning (mlx-lm's: top_p 0 or 1, top_k 0 and
    min_p 0 are "off", temperature 0 is greedy), one line naming the parameter."""
    if not _number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise RequestError("temperature", f"temperature must be a finite number >= 0 "
                                          f"(0 = greedy), not {temperature!r}")
    if not _number(top_p) or not 0 <= top_p <= 1:   # NaN fails the comparison too
        raise RequestError("top_p", f"top_p must be in [0, 1] (0 or 1 = off), not {top_p!r}")
    if not _integer(top_k) or top_k < 0:
        raise RequestError("top_k", f"top_k must be an integer >= 0 (0 = off), not {top_k!r}")
    if sampling not in SCHEMES:
        raise RequestError("sampling", f"sampling must be one of {', '.join(SCHEMES)}, "
                                       f"not {sampling!r}")
    if not _number(min_p) or not 0 <= min_p <= 1:
        raise RequestError("min_p", f"min_p must be in [0, 1] (0 = off), not {min_p!r}")
    if not _integer(min_tokens_to_keep) or min_tokens_to_keep < 1:
        raise RequestError("min_tokens_to_keep", f"min_tokens_to_keep must be an integer >= 1, "
                                                 f"not {min_tokens_to_keep!r}")


@dataclass(frozen=True)
class Sampler:
    """A request's sampling values, in the one shape every step reads (``Request.warping``),
    checked once, when it is made. How tokens are chosen; the same warping applies to target
    and draft distributions (logits/sampling.py: ``choose``, ``warped``).

    ``scheme`` (``request.SCHEMES``): "reproducible" gives, for a seed, the same tokens in
    every mode (serial, speculative, auto, any num_draft); "rejection" accepts more drafts
    but reproduces only in distribution. Both are exact samplers of the warped target;
    greedy (temperature 0) is the same in both. ``custom``: a user's ``sampler=``
    (logprobs ``[1, V]`` -> token), which replaces the warping and the noise; drafts are then
    kept while they equal its token for their row (as the coupled scheme)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    scheme: str = DEFAULT_SCHEME
    vocab: int | None = None    # ids at or above it are never drawn (Request.vocab_limit)
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    custom: Callable | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k, self.scheme, self.min_p,
                       self.min_tokens_to_keep)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.custom is None

    @property
    def noisy(self) -> bool:
        """Whether its draws take Gumbel noise (sampled, and not by a user's sampler)."""
        return not self.greedy and self.custom is None

    @property
    def coupled(self) -> bool:
        """Whether drafts are accepted while they equal the target's own token (greedy,
        "reproducible", a user's sampler), rather than by rejection sampling."""
        return not self.noisy or self.scheme == "reproducible"

    @property
    def settings(self) -> tuple:
        """The warping as plain values: what a compiled draw is specialised on (and cached
        by), in ``Draw.of``'s order."""
        return (self.temperature, self.top_p, self.top_k, self.vocab, self.min_p,
                self.min_tokens_to_keep)


def check_penalties(repetition_penalty, repetition_context_size, presence_penalty,
                    frequency_penalty):
    """Refuse penalties outside their meaning: ``repetition_penalty`` in
    :data:`REPETITION_PENALTY` (1 or None = off, mlx-lm's), a context of at least one token,
    presence and frequency penalties in [-2, 2] (OpenAI's range; 0 = off)."""
    least, most = REPETITION_PENALTY
    if repetition_penalty is not None and (not _number(repetition_penalty)
                                           or not least <= repetition_penalty <= most):
        raise RequestError("repetition_penalty", f"repetition_penalty must be in [{least:g}, "
                                                 f"{most:g}] (1 or None = off), not "
                                                 f"{repetition_penalty!r}")
    if not _integer(repetition_context_size) or repetition_context_size < 1:
        raise RequestError("repetition_context_size", f"repetition_context_size must be an "
                                                      f"integer >= 1, not "
                                                      f"{repetition_context_size!r}")
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if not _number(value) or not -2 <= value <= 2:
            raise RequestError(name, f"{name} must be in [-2, 2] (0 = off), not {value!r}")


@dataclass(frozen=True)
class Request:
    """One generation: the prompt's token ids and every option (mlx-lm's meanings: top_p 0 or 1
    and top_k 0 are "off", temperature 0 is greedy).

    ``speculative``: "auto" (the break-even controller), "on" (always), "off" (never; the
    drafter is not asked). ``num_draft``: drafts per round, or "auto": each round's length
    chosen for the most expected tokens per unit of time (decode/length.py). ``sampling``:
    "rejection" or "reproducible" (docs/sampling.md); None (the default) is "reproducible" when a seed is given, so that a seed means the same text in
    every mode, else "rejection". ``seed``: an integer in [0, 2**64), None for a random one
    (the one drawn is in ``Stats.seed``). ``stop_tokens``: ids that end the run (emitted, never
    fed); ``stop_strings``: texts that end it (cut before them, by the API's detokenizing
    layer). ``thinking``: a :class:`Thinking` when the prompt opened a thinking block (the
    API then tells reasoning from answer), else None. ``after_thinking``: the prompt ends with
    an empty thinking block (the chat template's form of thinking off), so the reply is an
    answer whose thinking tags the API still reads (a block the reply opens is reasoning, a
    stray tag is dropped: text/reasoning.py); with ``thinking`` None only. ``thinking_token_budget``: most tokens
    the reply thinks before the engine closes the block itself (None: no cap; without
    ``thinking`` there is nothing to cap). ``vocab_limit``: ids at or above it are never
    drawn, on the drafter's side as on the target's (the API sets it to the tokenizer's size
    when the model's vocabulary is padded past it). ``grammar``: a :class:`mlx_dspark.grammar.grammars.Grammar`
    bound to the tokenizer (api.make_request binds it) that every emitted token must follow;
    stop tokens then end a run only where the grammar is complete. ``logprobs``: score each
    emitted token under the target's own distribution (its logits before any warping or
    mask), with this many top alternatives (0..20), read off the rows the generation computed
    anyway (``Stats.logprobs``); None: not scored.

    mlx-lm's sampling knobs (docs/sampling.md, "Penalties and processors"): ``min_p`` (0 =
    off) with ``min_tokens_to_keep``; ``repetition_penalty`` (None or 1 = off) over the last
    ``repetition_context_size`` tokens of the sequence, prompt included; ``presence_penalty``
    and ``frequency_penalty`` (OpenAI's, 0 = off) over the generated tokens;
    ``logit_bias`` ({id: bias}, OpenAI's and mlx-lm's, added to the logits; kept as sorted
    pairs); ``logits_processors``, callables ``(tokens, logits) -> logits`` applied in order
    to every row with the tokens before it; ``sampler``, a callable ``logprobs -> token`` that
    replaces temperature, top-p, top-k and min-p (and the seed: it draws with ``mx.random``'s
    own state)."""

    prompt: tuple[int, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    sampling: str | None = None
    num_draft: int | str = 3
    speculative: str = "auto"
    seed: int | None = None
    stop_tokens: frozenset = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()
    grammar: object = None
    thinking: Thinking | None = None
    thinking_token_budget: int | None = None
    vocab_limit: int | None = None
    logprobs: int | None = None
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    logits_processors: tuple = ()
    sampler: object = None
    after_thinking: bool = False
    # the sampling values above as the one Sampler every step reads (made, and checked, once
    # here)
    warping: Sampler = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "speculative", speculative_mode(self.speculative))
        object.__setattr__(self, "stop_tokens", frozenset(self.stop_tokens))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not isinstance(self.logits_processors, (list, tuple)):
            raise RequestError("logits_processors", f"logits_processors must be a list of "
                                                    f"callables (tokens, logits) -> logits, not "
                                                    f"{type(self.logits_processors).__name__}")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        if self.sampling is None:
            object.__setattr__(self, "sampling", SEEDED_SCHEME if self.seed is not None
                               else DEFAULT_SCHEME)
        self._check()

    def _check(self):
        if not self.prompt:
            raise RequestError("prompt", "empty prompt: give some text or at least one token id")
        if not all(_integer(t) for t in self.prompt):
            raise RequestError("prompt", "a prompt of token ids holds integers only")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError("max_tokens", f"max_tokens must be at least 1, not "
                                             f"{self.max_tokens!r}")
        object.__setattr__(self, "warping", Sampler(
            self.temperature, self.top_p, self.top_k, self.sampling, self.vocab_limit,
            self.min_p, self.min_tokens_to_keep, self.sampler))
        check_penalties(self.repetition_penalty, self.repetition_context_size,
                        self.presence_penalty, self.frequency_penalty)
        self._check_callables()
        if self.num_draft != AUTO_DRAFT and (not _integer(self.num_draft)
                                             or not 1 <= self.num_draft <= MAX_DRAFT):
            raise RequestError("num_draft", f"num_draft must be an integer in [1, {MAX_DRAFT}] "
                                            f"or {AUTO_DRAFT!r}, not {self.num_draft!r}")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed < SEEDS):
            raise RequestError("seed", f"seed must be an integer in [0, 2**64) or None, not "
                                       f"{self.seed!r}")
        if not all(_integer(t) and t >= 0 for t in self.stop_tokens):
            raise RequestError("stop", "stop token ids must be integers >= 0")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise RequestError("stop", "stop strings must be non-empty strings")
        # a grammar.Grammar (not imported: decode/grammar.py imports this module)
        if self.grammar is not None and not isinstance(getattr(self.grammar, "source", None),
                                                       str):
            raise RequestError("grammar", f"grammar must be a mlx_dspark.grammar.grammars.Grammar, "
                                          f"not {type(self.grammar).__name__}")
        budget = self.thinking_token_budget
        if budget is not None and (not _integer(budget) or budget < 0):
            raise RequestError("thinking_token_budget", f"thinking_token_budget must be an "
                                                        f"integer >= 0, not {budget!r}")
        if self.thinking is not None and self.after_thinking:
            raise RequestError("after_thinking", "a reply cannot start both inside a thinking "
                                                 "block and after one")
        if self.thinking is not None and not (self.thinking.end and self.thinking.close):
            raise RequestError("thinking", "thinking needs the closing tag's ids and the ids "
                                           "that end a thinking block")
        if self.logprobs is not None and (not _integer(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] "
                                           f"(alternatives per token) or None, not "
                                           f"{self.logprobs!r}")
        if self.vocab_limit is not None and (not _integer(self.vocab_limit)
                                             or self.vocab_limit < 1):
            raise RequestError("vocab_limit", f"vocab_limit must be an integer >= 1 or None, "
                                              f"not {self.vocab_limit!r}")

    def _check_callables(self):
        if not all(callable(f) for f in self.logits_processors):
            raise RequestError("logits_processors", "logits_processors must be a list of "
                                                    "callables (tokens, logits) -> logits")
        if self.sampler is None:
            return
        if not callable(self.sampler):
            raise RequestError("sampler", f"sampler must be a callable logprobs -> token, not "
                                          f"{type(self.sampler).__name__}")
        own = [name for name, on in (("temperature", self.temperature != 0),
                                     ("top_p", self.top_p not in (0, 1)),
                                     ("top_k", self.top_k != 0), ("min_p", self.min_p != 0),
                                     ("seed", self.seed is not None)) if on]
        if own:
            raise RequestError(own[0], f"sampler= chooses the tokens itself (with mx.random's "
                                       f"own state): give it or {', '.join(own)}, not both")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.sampler is None


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a dict {token id: bias}, or its pairs) as sorted ``(id, bias)`` pairs;
    RequestError unless every id is an integer >= 0 and every bias a finite number."""
    if bias is None:
        return ()
    try:
        pairs = sorted((dict(bias)).items())
    except (TypeError, ValueError):
        raise RequestError("logit_bias", f"logit_bias must map token ids to numbers, not "
                                         f"{bias!r}") from None
    for token, value in pairs:
        if not _integer(token) or token < 0 or not _number(value) or not math.isfinite(value):
            raise RequestError("logit_bias", f"logit_bias maps token ids (integers >= 0) to "
                                             f"finite numbers, not {token!r}: {value!r}")
    return tuple((token, float(value)) for token, value in pairs)


def split_stops(stop) -> tuple[tuple[str, ...], frozenset]:
    """``stop`` as the API takes it (None, a string, an id, or a list of both) split into stop
    strings and stop token ids."""
    if stop is not None and not isinstance(stop, (str, int, list, tuple, frozenset, set)) \
            or isinstance(stop, bool):
        raise RequestError("stop", f"stop must be a string, a token id or a list of them, "
                                   f"not {stop!r}")
    stop = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    strings = tuple(s for s in stop if isinstance(s, str))
    ids = frozenset(s for s in stop if not isinstance(s, str))
    return strings, ids
