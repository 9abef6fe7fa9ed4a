"""Log-probabilities of a reply's tokens under the target's own distribution (the logits
before temperature, top-p or top-k), for the server's ``logprobs`` fields.

A reply's tokens are scored after it is generated, by the target on a cache of its own: the
prompt in one step, then the reply's tokens in one more. The scores depend only on the
tokens, so a speculative reply and a serial one with the same tokens get the same numbers.
The cost is one prefill of the prompt and the reply, paid only by requests that ask."""

from __future__ import annotations

import mlx.core as mx


def score(target, prompt: list[int], tokens: list[int], top: int) -> list[tuple]:
    """``(token, logprob, [(id, logprob), ...] the top alternatives)`` for each token."""
    if not tokens:
        return []
    cache = target.make_cache()
    first, _ = target.step(mx.array([prompt]), cache, last_only=True)
    rows = [first[0, -1:]]
    if len(tokens) > 1:
        rest, _ = target.step(mx.array([tokens[:-1]]), cache)
        rows.append(rest[0])
    logp = mx.concatenate(rows).astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    order = mx.argsort(-logp, axis=-1)[:, :top] if top else None
    alts = mx.take_along_axis(logp, order, axis=-1) if top else None
    chosen = chosen.tolist()
    order, alts = (order.tolist(), alts.tolist()) if top else ([[]] * len(tokens),) * 2
    return [(t, lp, list(zip(o, a))) for t, lp, o, a in zip(tokens, chosen, order, alts)]


def openai(kind: str, scores: list[tuple], tokenizer) -> dict:
    """The ``logprobs`` object of a chat choice (``content``) or a completion choice."""
    def text(i):
        return tokenizer.decode([i])

    if kind == "chat":
        def entry(i, lp):
            t = text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, a) for i, a in alts]}
                            for t, lp, alts in scores]}
    tokens = [text(t) for t, _, _ in scores]
    offsets = [sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in scores],
            "top_logprobs": [{text(i): a for i, a in alts} for _, _, alts in scores],
            "text_offset": offsets}
