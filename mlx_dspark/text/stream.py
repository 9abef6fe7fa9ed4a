"""The chunk stream: a generation's tokens detokenized, stop strings cut, the thinking split
off, one :class:`Chunk` per token; the same for ``generate()``, the CLI and every server
protocol."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Iterator

from ..request import Request
from ..stats import Stats
from . import reasoning
from .stops import StopScanner

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


def chunks(pair, request: Request, tokens: Iterator[int], stats: Stats) -> Iterator[Chunk]:
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
