"""Log-probabilities of a reply's tokens under the target's own distribution (the logits
before temperature, top-p or top-k), for the server's ``logprobs`` fields.

They are read off the rows the generation itself computed (``Request.logprobs``: the loop
scores each token from the serial step's or the verify pass's row it was chosen from), so
asking costs a log-softmax and a sort per token, not a second pass. The numbers depend only on
the tokens, up to float rounding between a verify pass and a serial step (about 1e-6). A reply
whose tokens the loop did not all choose itself (a thinking budget writes the end of the
thinking block) is scored again by the target on a cache of its own, prompt and reply in two
steps (:func:`score`)."""

from __future__ import annotations

import mlx.core as mx

from ..models.media_rows import step_input


def of_reply(target, request, tokens: list[int], scored: list | None) -> list[tuple]:
    """``(token, logprob, alternatives)`` for each of the reply's ``tokens`` (stop tokens
    left out): the generation's own scores (``Stats.logprobs``) when they cover exactly these
    tokens, else scored again (:func:`score`)."""
    if scored is not None and [t for t, _, _ in scored[:len(tokens)]] == tokens:
        return scored[:len(tokens)]
    return score(target, list(request.prompt), tokens, request.logprobs)


def score(target, prompt: list[int], tokens: list[int], top: int) -> list[tuple]:
    """``(token, logprob, [(id, logprob), ...] the top alternatives)`` for each token."""
    if not tokens:
        return []
    cache = target.make_cache()
    first, _ = target.step(step_input(target, prompt), cache, last_only=True)
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
