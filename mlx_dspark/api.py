"""The public API (ARCHITECTURE.md): ``load``, ``generate``, ``stream_generate``.

``generate`` is ``stream_generate`` collected, so streaming yields exactly the text the
non-streaming call returns."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .integrity import check_level
from .speculative import Sampler, Session, Stats, decode
from .tokenizer import encode, load_tokenizer

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

    def session(self, speculative="auto") -> Session:
        """A reusable decoding state: pass it to successive calls whose prompts extend each
        other (a chat) and only the new tokens are prefilled. One live session per pair:
        a session owns the drafter's context while it is used. The pair keeps what the
        session's controller learns."""
        return Session(self.target, self.drafter, _speculative(speculative), home=self)


@dataclass
class Chunk:
    """One streamed piece: the text that became printable with ``token``.

    As in mlx-lm, every chunk carries a generated token and the last one carries the finish
    reason ("stop" or "length"; None before). When a stop token ends the run, the last chunk's
    ``token`` is that stop token: it is not part of ``Result.tokens`` and its text is only what
    the detokenizer still held back."""

    text: str
    token: int
    stats: dict

    @property
    def finish_reason(self):
        return self.stats["finish_reason"]


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: dict

    @property
    def finish_reason(self):
        return self.stats["finish_reason"]


def load(model=None, drafter=None, dtype=None, verify: str = "auto",
         memory_check: bool = True) -> Pair:
    """Load a converted target (and drafter).

    ``model``/``drafter``: local directories of converted checkpoints, or Hugging Face repo ids
    of ModelOpt exports, converted on first use into the cache (model_cache.py). A local
    directory wins over a repo id of the same spelling. ``model=None`` loads the embedded
    demonstration pair (a small demo model, not Nemotron); then ``drafter=None`` means the demo
    drafter. With an explicit ``model``, ``drafter=None`` means no drafter (serial decoding).
    ``verify``: how much of both checkpoints is checked against their conversion receipts
    before loading: ``"auto"`` (default: every byte of a small checkpoint, sizes and sampled
    blocks of a large one), ``"full"``, ``"fast"``, or ``"none"`` for directories without a
    receipt (docs/integrity.md). ``memory_check``: first estimate what the pair needs and raise
    memory.InsufficientMemory (a ValueError) when the device cannot give it
    (docs/real-size.md)."""
    from . import model_cache
    from .drafter import load_drafter
    from .memory import check_fits
    from .target import default_dtype, load_target

    if model is None:
        model = DEMO / "target"
        drafter = DEMO / "drafter" if drafter is None else drafter
    check_level(verify)
    for name, what in ((model, "model"), (drafter, "drafter")):
        if name is not None and not model_cache.is_repo_id(name) \
                and not Path(name).expanduser().is_dir():
            raise FileNotFoundError(f"{name}: no such {what} directory")
    model = model_cache.resolve(model)
    drafter = model_cache.resolve(drafter) if drafter is not None else None
    if memory_check:
        check_fits(model, drafter, dtype or default_dtype())
    target = load_target(model, dtype=dtype, verify=verify)
    return Pair(target=target,
                drafter=(load_drafter(drafter, target, verify=verify)
                         if drafter is not None else None),
                tokenizer=load_tokenizer(model, target.config.vocab_size))


def stream_generate(pair: Pair, prompt, max_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    num_draft: int = 3, speculative="auto", stop=None, chat: bool = False,
                    session: Session | None = None,
                    chat_template_kwargs: dict | None = None,
                    sampling: str = "rejection") -> Iterator[Chunk]:
    """Yield one chunk per generated token; the last one carries the finish reason.

    ``prompt``: a str (encoded with the tokenizer; ``chat=True`` applies the chat template), a
    list of chat messages, or a list of token ids used verbatim; ``chat_template_kwargs``
    (such as ``{"enable_thinking": False}``) go to the chat template. ``speculative``: "auto",
    True/"on" or False/"off". ``stop``: extra stop token ids (ints) and/or stop strings; the
    tokenizer's eos ids always stop. A stop token is not part of the output; a stop string
    ends the text just before it (the token that completed it is kept in ``tokens``).

    ``sampling``: "rejection" (the default: more drafts accepted) or "reproducible" (a ``seed``
    gives the same tokens whether or not and however the drafter speculates); both sample
    exactly the warped target (docs/sampling.md). Greedy decoding is the same in both."""
    speculative = _speculative(speculative)
    sampler = Sampler(temperature, top_p, top_k, sampling)   # refuses nonsense before loading
    prompt_ids = _prompt_ids(pair, prompt, chat, chat_template_kwargs)
    stop_strings, stop_tokens = _stops(pair, stop)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")

    stats = Stats()
    tok = pair.tokenizer
    detok = tok.detokenizer if tok is not None else None
    if detok is not None:
        detok.reset()
    shown = 0        # characters of the detokenized text already yielded
    if session is None:
        session = pair.session(speculative)
    tokens = decode(pair.target, pair.drafter, prompt_ids, max_tokens=max_tokens,
                    sampler=sampler, num_draft=num_draft,
                    speculative=speculative, seed=seed, stop_tokens=stop_tokens, stats=stats,
                    session=session)
    try:
        for token in tokens:
            last = stats.finish_reason is not None     # decode names it before the last token
            if detok is None:
                yield Chunk("", token, _with_memory(stats))
                continue
            if token not in stop_tokens:
                detok.add_token(token)
            if last:
                detok.finalize()
            text = detok.text
            cut = _find_stop(text, stop_strings, max(0, shown - _longest(stop_strings)))
            if cut is not None:
                stats.finish_reason = "stop"
                yield Chunk(text[shown:cut], token, _with_memory(stats))
                return
            end = len(text) if last else len(text) - _held_back(text, stop_strings)
            yield Chunk(text[shown:end], token, _with_memory(stats))
            shown = max(shown, end)
    finally:
        tokens.close()


def generate(pair: Pair, prompt, max_tokens: int = 256, **kwargs) -> Result:
    """Generate and return the whole result (same arguments as ``stream_generate``)."""
    _, stop_tokens = _stops(pair, kwargs.get("stop"))
    text, tokens, stats = [], [], {}
    for chunk in stream_generate(pair, prompt, max_tokens=max_tokens, **kwargs):
        text.append(chunk.text)
        if not (chunk.finish_reason == "stop" and chunk.token in stop_tokens):
            tokens.append(chunk.token)
        stats = chunk.stats
    return Result("".join(text), tokens, stats)


_SPECULATIVE = {"auto": "auto", "on": True, "off": False, True: True, False: False}


def _speculative(value):
    """The CLI's words ("on", "off", "auto") and the booleans, as the loop takes them."""
    if isinstance(value, (str, bool)) and value in _SPECULATIVE:
        return _SPECULATIVE[value]
    raise ValueError(f"speculative must be 'auto', 'on', 'off', True or False, not {value!r}")


def _stops(pair: Pair, stop) -> tuple[list[str], set[int]]:
    """Stop strings and stop token ids (the tokenizer's eos ids always among them)."""
    stop = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    strings = [s for s in stop if isinstance(s, str)]
    ids = {s for s in stop if not isinstance(s, str)}
    if pair.tokenizer is not None:
        ids |= set(pair.tokenizer.eos_token_ids)
    elif strings:
        raise ValueError("stop strings need a tokenizer")
    if any(not s for s in strings):
        raise ValueError("empty stop string")
    return strings, ids


def _with_memory(stats: Stats) -> dict:
    """The stats dict plus peak memory so far: MLX's allocator (weights, caches,
    activations) and the process's peak resident set, both in GB (10^9 bytes, as mlx-lm)."""
    import mlx.core as mx
    return dict(stats.as_dict(), peak_memory_gb=mx.get_peak_memory() / 1e9,
                peak_rss_gb=_peak_rss_bytes() / 1e9)


def _peak_rss_bytes() -> int:
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024     # macOS: bytes; Linux: KiB


def _prompt_ids(pair: Pair, prompt, chat: bool, options: dict | None) -> list[int]:
    if not prompt:
        raise ValueError("empty prompt: give some text or at least one token id")
    if all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if pair.tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this pair has none")
    return encode(pair.tokenizer, prompt, chat, options)


def _find_stop(text: str, stop_strings, start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop_strings) -> int:
    """Length of the longest end of ``text`` that could be the start of a stop string."""
    best = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _longest(stop_strings) -> int:
    return max((len(s) for s in stop_strings), default=0)
