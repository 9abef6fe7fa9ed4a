"""A stand-in target that writes a chosen reply, for tests of what is read out of replies
(thinking, tool calls) through the real loop, API and server.

Each prefill piece (a step of more than one token, or one the loop's prefill takes with
``last_only``: a prompt's last piece may be its last token alone, unless that token is the one
the reply wrote there, as a thinking budget's next stretch feeds) asks ``choose(prompt_ids)``
for the reply's token ids; after it, the target's greedy choice at each position is the reply's next
token, then ``end`` (an eos id) for ever. It implements what the serial loop calls on a target
(``make_cache``, ``step``, ``config.vocab_size``, ``context_limit``); there is no drafter for
it, so sessions on it decode serially."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class _Config:
    vocab_size: int
    hybrid_override_pattern: str = ""       # no layers: a snapshot holds no layer state


class ScriptedState(tuple):
    """A snapshot of a :class:`ScriptedCache` as a session checks one (positions, no
    layers), carrying the tokens and the reply (a copy: a prompt cache restores it into any
    other state)."""

    def __new__(cls, tokens, start: int, reply: tuple):
        state = super().__new__(cls, (len(tokens), ()))
        state.scripted = (tuple(tokens), start, reply)
        return state


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

    def snapshot(self) -> ScriptedState:
        return ScriptedState(self.tokens, self.start, self.reply)

    def restore(self, state: ScriptedState):
        tokens, self.start, self.reply = state.scripted
        self.tokens = list(tokens)

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
        written = len(new) == 1 and new[0] == self._next(cache, len(cache.tokens)) \
            and cache.start <= len(cache.tokens) < cache.start + len(cache.reply)
        cache.tokens += new
        if len(new) > 1 or (last_only and not written):
            cache.start, cache.reply = len(cache.tokens), tuple(self.choose(list(cache.tokens)))
        rows = range(len(cache.tokens) - (1 if last_only else len(new)), len(cache.tokens))
        ids = [self._next(cache, p + 1) for p in rows]
        logits = mx.full((len(ids), self.config.vocab_size), -30.0)
        logits[mx.arange(len(ids)), mx.array(ids)] = 0.0
        return logits[None], None

    def _next(self, cache: ScriptedCache, position: int) -> int:
        k = position - cache.start
        return cache.reply[k] if 0 <= k < len(cache.reply) else self.end


def by_tool_results(tokenizer, replies: list[str]):
    """A ``choose`` for an agent's turns: the reply after k tool results is ``replies[k]``
    (the last one once they run out). A reply without ``</think>`` to a prompt that opens a
    thinking block (a client that asks for thinking) thinks one line first."""
    from mlx_dspark.text import reasoning

    def choose(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        reply = replies[min(text.count("<tool_response>"), len(replies) - 1)]
        if reasoning.opens_thinking(text[-64:]) and reasoning.CLOSE not in reply:
            reply = "Thinking it over." + reasoning.END + reply
        return tokenizer.encode(reply, add_special_tokens=False)
    return choose


def main(argv=None):
    """``python -m testkit.scripted REPLIES.json --port N [--api-key K]
    [--prefix-cache-mb MB]``: a real server whose target writes the replies of REPLIES.json
    (a list of strings, chosen by how many tool results the prompt holds), with the demo
    pair's tokenizer."""
    import argparse
    import json
    from pathlib import Path

    from mlx_dspark import api
    from mlx_dspark.serve.app import listen, serve
    from mlx_dspark.serve.engine import Engine
    from mlx_dspark.text.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="testkit.scripted")
    p.add_argument("replies", type=Path)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key")
    p.add_argument("--prefix-cache-mb", type=int, default=0,
                   help="memory for prompt-cache snapshots (default 0: none)")
    args = p.parse_args(argv)
    replies = json.loads(args.replies.read_text())

    def load():
        tokenizer = load_tokenizer(api.DEMO / "target")
        target = ScriptedTarget(4096, by_tool_results(tokenizer, replies),
                                tokenizer.eos_token_id)
        return api.Pair(target, None, tokenizer)

    engine = Engine(load, max_queue=4, cache_bytes=args.prefix_cache_mb << 20,
                    use_drafter=False)
    engine.start()
    try:
        serve(engine, "scripted", listen("127.0.0.1", args.port), args.api_key)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
