"""A thinking budget, around the loop: a request whose thinking may take at most
``thinking_token_budget`` tokens, decoded as stretches of the loop on one session.

Three stretches: the reply decoded up to the budget; then, unless the model closed its block
itself, the ids of ``request.thinking.end`` (the template's end of thinking) emitted as the
reply's next tokens; then the rest decoded from a prompt that is the request's prompt, the
reply so far and those ids. That prompt extends what the session holds (the budget's last
token and the closing ids are prefilled through the target, their taps queued for the
drafter), so both caches hold exactly the state of that token sequence, as when a chat's next
turn extends the session. ``stats`` shows the stretches as one generation (the prompt is the
request's; tokens, rounds and times add up). The constraint follows the whole reply, the
closing ids included.

The loop is reached through ``stretch(request, stats)``, which decodes one stretch on the
call's session; ``call`` (run.Call) is the call they belong to: its constraint, and
``still_current()``, which refuses a call whose session was taken over."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from ..request import Request
from ..stats import Stats
from .run import Call


def applies(request: Request) -> bool:
    """Whether ``request`` has a thinking budget to keep."""
    return request.thinking is not None and request.thinking_token_budget is not None


def think_within_budget(request: Request, stats: Stats, call: Call,
                        stretch: Callable[[Request, Stats], Iterator[int]]) -> Iterator[int]:
    """The tokens of ``request`` with its thinking capped at its budget."""
    budget, end = request.thinking_token_budget, list(request.thinking.end)
    replace = dataclasses.replace
    parts: list[Stats] = []
    reply: list[int] = []

    def show(part: Stats | None, finish: str | None):
        runs = parts + ([part] if part is not None else [])
        merged = Stats.total(runs) if runs else Stats(requested=request.speculative)
        merged.prompt_tokens = len(request.prompt)
        merged.reused_tokens = runs[0].reused_tokens if runs else 0
        merged.generated, merged.generations = len(reply), max(1, len(runs))
        merged.finish_reason = finish
        merged.finish_detail = None if finish != "length" else \
            "max_tokens" if len(reply) >= request.max_tokens else "context"
        vars(stats).update(vars(merged))

    def room() -> int:
        """Tokens the reply may still take (max_tokens, and the context beyond the prompt
        the next stretch will have)."""
        left = request.max_tokens - len(reply)
        limit = call.session.target.context_limit
        if limit is not None:
            left = min(left, limit - len(request.prompt) - len(reply) - 1)
        return left

    if budget > 0:
        first = replace(request, max_tokens=min(budget, request.max_tokens),
                        thinking_token_budget=None)
        part = Stats()
        for token in stretch(first, part):
            reply.append(token)
            done = part.finish_reason == "stop" or part.finish_reason is not None and room() <= 0
            show(part, part.finish_reason if done else None)
            yield token
            if done:
                return
        parts.append(part)
        call.constraint.advance(reply[-1])      # a stretch's last token is not consumed by it
    if not _contains(reply, request.thinking.close):
        for token in end:
            reply.append(token)
            show(None, "length" if room() <= 0 else None)
            yield token
            if stats.finish_reason is not None:
                return
            call.constraint.advance(token)
            call.still_current()
    # "reproducible" noise is keyed by position, so the rest keeps the seed; "rejection" draws
    # from a key stream, which the rest must not replay from its start.
    seed = request.seed
    if seed is not None and request.sampling != "reproducible":
        seed ^= 0x5DEECE66D
    rest = replace(request, prompt=request.prompt + tuple(reply), max_tokens=room(),
                   thinking_token_budget=None, seed=seed)
    part = Stats()
    for token in stretch(rest, part):
        reply.append(token)
        show(part, part.finish_reason)
        yield token


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(seq[i:i + n]) == sub for i in range(len(seq) - n + 1))
