"""The public API (ARCHITECTURE.md): ``load``, ``generate``, ``stream_generate``.

``generate`` is ``stream_generate`` collected, so streaming yields exactly the text the
non-streaming call returns. Both build one :class:`~mlx_dspark.request.Request` from their
keywords and hand it, with a session, to :func:`stream`, which the CLI and the server call
with requests of their own."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .checkpoint.integrity import check_level
from .decode.session import Session
from .decode.warm import warm_up  # noqa: F401 (public: load(warm=True), the CLI)
from .models.media_rows import text_ids
from .request import Request, RequestError, speculative_mode, split_stops
from .stats import Stats, format_stats
from .text import reasoning
from .text.chat_template import check_template_variables
from .text.stops import StopScanner
from .text.tokenizer import load_tokenizer, message_boundaries, prompt_ids

DEMO = Path(__file__).parent / "demo"


@dataclass
class Pair:
    """A target, its drafter (None: serial decoding only) and the tokenizer (None: token-id
    prompts only, empty texts)."""

    target: object
    drafter: object = None
    tokenizer: object = None
    # What the break-even controller learned in earlier calls (costs, acceptance): a fresh
    # call starts from it instead of paying the warm-up round again.
    controller: object = field(default=None, repr=False)
    path: Path | None = None      # the target's directory (md.load sets it)
    # The target's and drafter's conversion-receipt hashes (None without a receipt): what
    # snapshots on disk are keyed to.
    receipts: tuple = (None, None)
    # Snapshots calls without a session continue from (prompt_cache.PromptCache), or None.
    prompt_cache: object = field(default=None, repr=False)
    # Which drafter and why, or "serial only (why)": the banners' words (md.load sets it).
    drafter_note: str = ""
    # MLX work on one pair runs one step at a time: generations from several threads take
    # turns token by token (and one thread may still interleave several generations).
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: where the target came from, which drafter and why (the dataclass's own
        repr printed every module of both models)."""
        where = str(self.path) if self.path is not None else type(self.target).__name__
        drafter = self.drafter_note or ("no drafter" if self.drafter is None
                                        else type(self.drafter).__name__)
        tokenizer = "" if self.tokenizer is not None else ", no tokenizer"
        return f"Pair({where}, {drafter}{tokenizer})"

    def session(self, speculative=None) -> Session:
        """A decoding state of its own (target and drafter caches): pass it to successive
        calls whose prompts extend each other (a chat) and only the new tokens are
        prefilled; a history rendered otherwise goes on from before the previous prompt's
        last token, and new messages alone continue the conversation held (mlx-lm's
        ``prompt_cache`` habit; docs/prompt-cache.md). Any number of sessions live on one
        pair. The pair keeps what the sessions' controller learns about this machine.

        The mode belongs to each call (``speculative=``); the argument here is accepted for
        code written before, and ignored."""
        if speculative is not None:
            speculative_mode(speculative)
            warnings.warn("pair.session(mode): a session no longer takes a mode; pass "
                          "speculative= to each generate() call", DeprecationWarning,
                          stacklevel=2)
        return Session(self.target, self.drafter, home=self, keep_prompt=True)

    def __iter__(self):
        # mlx-lm's ``model, tokenizer = load(...)``: one line with this package's spelling.
        raise TypeError("md.load() returns one Pair, not (model, tokenizer): write "
                        "`pair = md.load(...)` and `md.generate(pair, prompt)`; its parts are "
                        "pair.target, pair.drafter and pair.tokenizer")

    def __reduce_ex__(self, protocol):
        # pickle and copy: the models' MLX arrays and compiled kernels live in this process
        raise TypeError("a Pair cannot be pickled or copied: its models live in this "
                        "process's memory. Load the pair in the other process (md.load with "
                        "the same arguments); to carry a conversation's state over, give "
                        "both md.load(..., prompt_cache_dir=DIR) (snapshots on disk), or "
                        "use chat's /save and --resume; dataclasses.replace(pair, ...) "
                        "makes a variant in this process")

    @functools.cached_property
    def decodable(self) -> int | None:
        """How many ids the tokenizer can decode, when fewer than the model's vocabulary (a
        padded embedding); the others are never sampled. None when all can be."""
        if self.tokenizer is None:
            return None
        ids = max(self.tokenizer.get_vocab().values(), default=-1) + 1
        return ids if ids < self.target.config.vocab_size else None

    def stop_tokens(self) -> frozenset:
        """The ids that always end a generation (the tokenizer's eos ids)."""
        return frozenset(self.tokenizer.eos_token_ids) if self.tokenizer is not None \
            else frozenset()


@dataclass
class Chunk:
    """One streamed piece: the text that became printable with ``token``: ``text`` the
    answer's, ``reasoning`` the thinking's (a reply whose prompt opened a thinking block
    thinks until ``</think>``; one chunk may carry the end of one and the start of the
    other, ``part`` names what it carries; ``thinking``: ``token`` belongs to the thinking
    block, its closing tag included).

    As in mlx-lm, every chunk carries a generated token and the last one carries the finish
    reason ("stop" or "length"; None before). ``stop`` says whether ``token`` is a stop token
    (the last chunk's, when one ended the run): it is not part of ``Result.tokens`` and its
    text is only what the detokenizer still held back. ``stats`` is a snapshot of the run so
    far (:class:`~mlx_dspark.stats.Stats`; peak memory on the last chunk only). mlx-lm's
    fields are on every chunk, as they stand at its token: ``prompt_tokens``, ``prompt_tps``,
    ``generation_tokens``, ``generation_tps`` and ``peak_memory`` (MLX's peak so far, GB)."""

    text: str
    token: int
    stats: Stats
    stop: bool = False
    reasoning: str = ""
    thinking: bool = False
    stop_string: str | None = None      # the stop string that ended the run (last chunk)
    peak_memory: float = field(default_factory=lambda: _peak_bytes() / 1e9)  # GB, so far

    @property
    def finish_reason(self):
        return self.stats.finish_reason

    # what ended a "length" run: "max_tokens" or "context" (the model's limit)
    finish_detail = property(lambda self: self.stats.finish_detail)
    # mlx-lm's GenerationResponse fields, current on every chunk
    prompt_tokens = property(lambda self: self.stats.prompt_tokens)
    prompt_tps = property(lambda self: self.stats.prompt_tokens_per_s)
    generation_tokens = property(lambda self: self.stats.generated)
    generation_tps = property(lambda self: self.stats.tokens_per_s)

    @property
    def part(self) -> str | None:
        """"reasoning", "content", "both" (the block ends in this chunk), None (no text)."""
        return ("both" if self.text else "reasoning") if self.reasoning else \
            "content" if self.text else None


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


def load(model=None, drafter=None, dtype=None, verify: str = "auto",
         memory_check: bool = True, warm: bool = True,
         prompt_cache_dir=None, prompt_cache_disk_gb: float = 10.0,
         prompt_cache_mb: int = 1024, allowed_local_media_path=None) -> Pair:
    """Load a converted target (and drafter).

    ``dtype``: ``"bfloat16"``, ``"float16"``, ``"float32"`` or the MLX dtype (None: bf16 on a
    GPU, fp32 on the CPU). ``model``: a local directory of a converted target, or the Hugging
    Face repo id of a ModelOpt export, converted on first use into the cache (checkpoint/hub.py);
    a local directory wins over a repo id of the same spelling. ``drafter``: ``"mtp"`` (the
    target's own MTP block, kept by ``convert`` unless ``--no-mtp``), or a converted DSpark
    drafter or EAGLE-3 head (a directory or repo id; which one its config.json says).
    ``"none"``: no drafter. ``"auto"``: the drafter made for the model, recognised by its
    config (checkpoint/pairing.py: NVIDIA's DSpark drafter for Nemotron 3.5 Lightning, in any
    layout), else none; the CLI's default with ``--model``. ``model=None`` loads the embedded
    demonstration pair (a small demo model, not Nemotron); then ``drafter`` None or
    ``"dspark"`` (``"mtp"``, ``"eagle3"``, ``"dflash"``) names an embedded demo drafter. With
    an explicit ``model``, ``drafter=None`` means no drafter (serial decoding). ``model`` may
    be in mlx-lm's layout or a plain Hugging Face download, loaded as it is (docs/formats.md).
    ``verify``: how much of both checkpoints is checked against their conversion receipts
    before loading: ``"auto"`` (default: every byte of a small checkpoint, sizes and sampled
    blocks of a large one), ``"full"``, ``"fast"``, or ``"none"`` for directories without a
    receipt (docs/integrity.md). ``memory_check``: first estimate what the pair needs and raise
    memory.InsufficientMemory (a ValueError) when the device cannot give it
    (docs/history/real-size.md). ``warm``: run :func:`warm_up` before returning, so that the
    first generation is timed (and "auto" decides) on warm kernels.

    ``prompt_cache_dir``: calls without a ``session`` continue from snapshots of earlier
    prompts (message ends, every few thousand tokens, ends of prompts and answers), kept in
    memory (``prompt_cache_mb``) and in this directory (``prompt_cache_disk_gb``, least
    recently used first out), so a long shared prefix is prefilled once, across restarts
    (docs/prompt-cache.md).

    A Nemotron Omni parent with the ``omni`` extra installed takes images and audio as
    message content parts (docs/formats.md); ``allowed_local_media_path``: the directory
    whose files ``file://`` image URLs may name (none by default)."""
    from .checkpoint import hub, pairing
    from .checkpoint.formats import convert_first, detect_dir
    from .checkpoint.memory import check_download, check_fits
    from .checkpoint.recorded import recorded_hash
    from .drafters import DEFAULT_DEMO, check_pairing, load_drafter, locate, of_target
    from .media import omni as media
    from .models.nemotron_h import (TargetConfig, check_shapes, compute_dtype, load_target,
                                     read_target_config)
    from .prompt_cache.disk import receipt_hash

    why = {"none": "--drafter none", None: "no drafter named"}.get(drafter, "")
    demo = model is None
    if drafter == "none":
        drafter = None
    elif demo:
        drafter = locate(DEFAULT_DEMO if drafter in (None, "auto") else drafter, DEMO)
    elif drafter not in (None, "auto"):
        drafter = locate(drafter)   # a demo drafter's name without the demo target: refused
    model = DEMO / "target" if demo else model
    check_level(verify)
    check_sources(model, drafter)
    dtype = compute_dtype(dtype)
    model = hub.resolve(model, "model", check_download if memory_check else None)
    fmt = detect_dir(model)     # what cannot run (a drafter, another model, GGUF...): said first
    if fmt.layout == "modelopt":
        raise ValueError(convert_first(model, fmt))
    raw = read_target_config(model)
    if drafter == "auto":
        drafter, why = pairing.resolve_default(raw)
    elif drafter is not None and not of_target(drafter):
        drafter = hub.resolve(drafter, "drafter")
    # Config (against the safetensors headers), tokenizer and pairing first: what is wrong
    # with them is said before any weight is read, not after a multi-GB load.
    config = TargetConfig.from_dict(raw, str(Path(model) / "config.json"))
    check_shapes(model, raw, config, fmt)
    tokenizer = load_tokenizer(model, config.vocab_size)
    if drafter is not None:
        check_pairing(drafter, config)
    if memory_check:
        check_fits(model, drafter, dtype)
    target = load_target(model, dtype=dtype, verify=verify)
    own = receipt_hash(model) or recorded_hash(model)     # what disk snapshots are keyed by
    pair = Pair(target=target,
                drafter=(load_drafter(drafter, target, verify=verify)
                         if drafter is not None else None),
                tokenizer=tokenizer, path=Path(model),
                receipts=(own, f"{drafter}:{own}" if of_target(drafter)
                          else receipt_hash(drafter)))
    pair.drafter_note = drafter_note(pair.drafter, drafter, why, demo)
    media.attach(pair, allowed_local_media_path)
    if prompt_cache_dir is not None:
        from .prompt_cache.cache import PromptCache
        from .prompt_cache.disk import open_store
        store = open_store(prompt_cache_dir, pair, pair.drafter is not None,
                           int(prompt_cache_disk_gb * 1e9))
        pair.prompt_cache = PromptCache(prompt_cache_mb << 20, store)
    if warm:
        warm_up(pair)
    return pair


def kernel_cache_cold() -> bool:
    """Whether MLX's CPU backend will compile its kernels first (its disk cache, under the
    temporary directory, is empty): a fresh machine's first run. Always False on a GPU."""
    import tempfile

    import mlx.core as mx
    from .device import on_gpu

    if on_gpu():
        return False
    cache = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"
    return not any(cache.glob("*.so"))


def drafter_note(loaded, name, why: str, demo: bool) -> str:
    """The banners' words for a pair's drafter: "with its DSpark drafter" (the demo's, or the
    target's own MTP block), "with the EAGLE-3 drafter DIR (why)", "serial only (why)"."""
    from .drafters import of_target

    if loaded is None:
        return f"serial only ({why})"
    kind = getattr(loaded, "label", "DSpark")
    if demo or of_target(name):
        return f"with its {kind} drafter"
    return f"with the {kind} drafter {name}" + (f" ({why})" if why else "")


def load_another_drafter(pair: Pair, name, demo: bool, verify: str = "auto"):
    """One more drafter for ``pair``'s target (``bench --drafter A --drafter B``), named as
    :func:`load` names one (``demo``: the pair is the embedded demo pair)."""
    from .checkpoint import hub
    from .drafters import load_drafter, locate, of_target

    name = locate(name, DEMO if demo else None)
    if not of_target(name):
        if not hub.is_repo_id(name) and not Path(name).expanduser().is_dir():
            raise FileNotFoundError(f"{name}: no such drafter directory")
        name = hub.resolve(name)
    return load_drafter(name, pair.target, verify=verify)


def check_sources(model, drafter=None) -> None:
    """FileNotFoundError naming a ``model`` or ``drafter`` that is neither a directory nor a
    repo id: a check that reads nothing, made before anything slower (a port, a download)."""
    from .checkpoint import hub
    from .checkpoint.formats import file_kind
    from .drafters import of_target

    for name, what in ((model, "model"), (drafter, "drafter")):
        if name is not None and not of_target(name) and name not in ("none", "auto") \
                and not hub.is_repo_id(name) \
                and not Path(name).expanduser().is_dir():
            if Path(name).expanduser().is_file():
                raise FileNotFoundError(f"{name}: {file_kind(name)}, not a {what} directory; "
                                        f"mlx-dspark runs safetensors checkpoint directories "
                                        f"(docs/formats.md)")
            raise FileNotFoundError(f"{name}: no such {what} directory")


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
    from .decode import grammar as grammars
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
    "json_schema": {"schema": ...}}``) or ``grammar`` (a :mod:`mlx_dspark.decode.grammar` Grammar,
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
    from .decode.loop import decode

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


def chunks(pair: Pair, request: Request, tokens: Iterator[int], stats: Stats) -> Iterator[Chunk]:
    """The chunks of ``tokens``, the generation of ``request`` (decode's, or a batch row's
    fed by the server's engine), whose ``stats`` stand as they did when each token came:
    detokenized, stop strings cut, the thinking split off, one chunk per token."""
    stops, scanner = request.stop_tokens, StopScanner(request.stop_strings)
    detok = pair.tokenizer.detokenizer if pair.tokenizer is not None else None
    if detok is not None:
        detok.reset()
    splitter = reasoning.Splitter(request.thinking is not None) \
        if request.thinking is not None or request.after_thinking else None
    # Under a grammar a stop string cuts nothing: once seen, it ends the answer after the first
    # token at which the answer is complete (docs/grammar.md), so an answer that stops parses.
    complete_after = request.grammar.acceptor() \
        if request.stop_strings and request.grammar is not None else None
    seen = None          # the stop string seen, under a grammar

    def chunk(piece: str, token: int, last: bool, stop: bool = False) -> Chunk:
        if splitter is None:
            return Chunk(piece, token, _snapshot(stats, last), stop)
        inside = splitter.thinking
        thought, answer = splitter.add(piece)
        if last:
            thought += splitter.finish()[0]
        return Chunk(answer, token, _snapshot(stats, last), stop, thought, inside)

    shown = 0        # characters of the detokenized text already yielded
    scanned = 0      # of them, those the scanner let show (all of them, without a grammar)
    try:
        for token in _taking_turns(tokens, pair.lock):
            last = stats.finish_reason is not None     # decode names it before the last token
            stop = last and stats.finish_reason == "stop" and token in stops
            if detok is None:
                yield Chunk("", token, _snapshot(stats, last), stop)
                continue
            if not stop:
                detok.add_token(token)
            if last:
                detok.finalize()
            text = detok.text
            end, stop_string = (0, None) if seen else scanner.scan(text[scanned:])
            if stop_string is not None and complete_after is not None:
                seen, stop_string = stop_string, None
            complete = complete_after is not None and not stop and complete_after(token)
            if stop_string is not None or (seen and complete and not last):
                stats.finish_reason, stats.finish_detail = "stop", None
                cut = scanned + end if stop_string is not None else len(text)
                last_chunk = chunk(text[shown:cut], token, True)
                last_chunk.stop_string = stop_string or seen
                yield last_chunk
                return
            scanned += end
            end = len(text) if last or complete_after is not None else scanned
            yield chunk(text[shown:end], token, last, stop)
            shown = end
    finally:
        with pair.lock:
            tokens.close()


def _taking_turns(tokens: Iterator[int], lock) -> Iterator[int]:
    """``tokens``, each computed while holding ``lock`` (never held across a yield)."""
    while True:
        with lock:
            token = next(tokens, None)
        if token is None:
            return
        yield token


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


def _snapshot(stats: Stats, last: bool) -> Stats:
    """A copy of the stats for a chunk; the last one reads the peak memory (once): MLX's
    allocator (weights, caches, activations) and the process's peak resident set, in GB
    (10^9 bytes, as mlx-lm)."""
    if last:
        stats.peak_memory_gb = _peak_bytes() / 1e9
        stats.peak_rss_gb = _peak_rss_bytes() / 1e9
    return stats.snapshot()


def _peak_bytes() -> int:
    import mlx.core as mx
    return mx.get_peak_memory()


def _peak_rss_bytes() -> int:
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024     # macOS: bytes; Linux: KiB
