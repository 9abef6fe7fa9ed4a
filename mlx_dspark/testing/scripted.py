"""A stand-in target that writes a chosen reply, for tests of what is read out of replies
(thinking, tool calls) through the real loop, API and server.

Each prefill (a step of more than one token: a prompt) asks ``choose(prompt_ids)`` for the
reply's token ids; after it, the target's greedy choice at each position is the reply's next
token, then ``end`` (an eos id) for ever. It implements what the serial loop calls on a target
(``make_cache``, ``step``, ``config.vocab_size``, ``context_limit``); there is no drafter for
it, so sessions on it decode serially."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class _Config:
    vocab_size: int


@dataclass
class ScriptedCache:
    tokens: list = field(default_factory=list)
    start: int = 0                # where the reply of the last prefill starts
    reply: tuple = ()

    def mark(self):
        return len(self.tokens), self.start, self.reply

    def rewind(self, mark):
        n, self.start, self.reply = mark
        del self.tokens[n:]

    def snapshot(self):
        return self.mark()

    def restore(self, state):
        self.rewind(state)

    def arrays(self):
        return []


class ScriptedTarget:
    context_limit = None

    def __init__(self, vocab_size: int, choose, end: int):
        self.config = _Config(vocab_size)
        self.choose, self.end = choose, end

    def make_cache(self) -> ScriptedCache:
        return ScriptedCache()

    def step(self, tokens: mx.array, cache: ScriptedCache, tap_layers=None, last_only=False):
        new = tokens.reshape(-1).tolist()
        cache.tokens += new
        if len(new) > 1:
            cache.start, cache.reply = len(cache.tokens), tuple(self.choose(list(cache.tokens)))
        rows = range(len(cache.tokens) - (1 if last_only else len(new)), len(cache.tokens))
        ids = [self._next(cache, p + 1) for p in rows]
        logits = mx.full((len(ids), self.config.vocab_size), -30.0)
        logits[mx.arange(len(ids)), mx.array(ids)] = 0.0
        return logits[None], None

    def _next(self, cache: ScriptedCache, position: int) -> int:
        k = position - cache.start
        return cache.reply[k] if 0 <= k < len(cache.reply) else self.end
