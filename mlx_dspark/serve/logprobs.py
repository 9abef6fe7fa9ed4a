"""Log-probabilities of a reply's tokens under the target's own distribution (the logits
before temperature, top-p or top-k), for the server's ``logprobs`` fields.

They are read off the rows the generation itself computed (``Request.logprobs``: the loop
scores each token from the serial step's or the verify pass's row it was chosen from, a thinking
budget's closing ids from the prefill that feeds them), so asking costs a log-softmax and a
sort per token, never a second pass (nor a prefill inside a batch). The numbers depend only on
the tokens, up to float rounding between a verify pass and a serial step (about 1e-6)."""

from __future__ import annotations


def of_reply(tokens: list[int], stats) -> list[tuple]:
    """``(token, logprob, alternatives)`` for each of the reply's ``tokens`` (stop tokens
    left out), from the generation's ``stats`` (Stats.scores: those set with its last token,
    or read so far when a stop string ended the reply before it)."""
    scored = (stats.scores() or [])[:len(tokens)]
    if [t for t, _, _ in scored] != tokens:
        raise RuntimeError("the generation's scores are not its reply's tokens")
    return scored


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
