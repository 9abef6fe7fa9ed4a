"""A thinking budget: a request whose thinking may take at most
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

A :class:`Plan` keeps a budgeted reply as its stretches go; its row (run.Row, in the batch
that ``decode`` runs as a batch of one) begins each stretch on its session (its constraint,
and ``still_current()``, which refuses a row whose session was taken over), so a budgeted row
decodes beside the others exactly as alone. The last stretch's prompt ends with the closing
ids (``Row.forced``), which its prefill
scores when logprobs are asked: the reply's log-probabilities are the stretches' own, none is
scored again."""

from __future__ import annotations

import dataclasses
import weakref

import mlx.core as mx

from ..request import Request
from ..stats import Stats
from .prefill import prefill_steps, reuse, to_the_end
from .run import Row, read_scores
from ..logits.sampling import log_probs


def applies(request: Request) -> bool:
    """Whether ``request`` has a thinking budget to keep."""
    return request.thinking is not None and request.thinking_token_budget is not None


class Plan:
    """The stretches of a request with a thinking budget, as they go: the reply so far and
    its stretches' stats, shown in ``stats`` as one generation. Its steps, in order:
    :meth:`thinking` (the first stretch's request, None for a budget of 0) whose tokens go
    to :meth:`took`, then :meth:`closing` (the ids that close the block, each to
    :meth:`closed` and, unless that ended the reply, :meth:`advance`), then :meth:`rest`
    (the last stretch's request, its tokens to :meth:`took`)."""

    def __init__(self, request: Request, stats: Stats, row: Row):
        self.request, self.stats, self.row = request, stats, row
        self.parts: list[Stats] = []
        self.reply: list[int] = []
        self.resting = False            # the last stretch runs
        self.written: list = []         # the closing ids' scores, when they end the reply
        self.runs: list[Stats] = []     # the stretches' stats shown last

    def thinking(self) -> Request | None:
        budget = self.request.thinking_token_budget
        if budget <= 0:
            return None
        return dataclasses.replace(self.request, max_tokens=min(budget, self.request.max_tokens),
                                   thinking_token_budget=None)

    def took(self, token: int, part: Stats) -> bool:
        """A token of a stretch (``part``: its stats so far): whether it ends the reply."""
        self.reply.append(token)
        if self.resting:
            self.show(part, part.finish_reason)
            return part.finish_reason is not None
        done = part.finish_reason == "stop" or part.finish_reason is not None and self.room() <= 0
        self.show(part, part.finish_reason if done else None)
        return done

    def closing(self, part: Stats | None) -> list[int]:
        """The first stretch (``part``; None: there was none) ended within the reply: the ids
        to emit next, the template's end of thinking unless the model closed it itself."""
        if part is not None:
            self.parts.append(part)
            self.row.constraint.advance(self.reply[-1])    # a stretch's last token is not
        if _contains(self.reply, self.request.thinking.close):      # consumed by it
            return []
        return list(self.request.thinking.end)

    def closed(self, token: int) -> bool:
        """A closing id emitted: whether it ends the reply (no room is left)."""
        self.reply.append(token)
        over = self.room() <= 0
        if over and self.request.logprobs is not None:
            self.written = self._score_written()
        self.show(None, "length" if over else None)
        return over

    def advance(self, token: int):
        """A closing id that did not end the reply: the constraint follows it."""
        self.row.constraint.advance(token)
        self.row.still_current()

    def rest(self) -> Request:
        """The last stretch: its prompt the request's, the reply so far and the closing ids."""
        self.resting = True
        # "reproducible" noise is keyed by position, so the rest keeps the seed; "rejection"
        # draws from a key stream, which the rest must not replay from its start.
        seed = self.request.seed
        if seed is not None and self.request.sampling != "reproducible":
            seed ^= 0x5DEECE66D
        return dataclasses.replace(self.request, prompt=self.request.prompt + tuple(self.reply),
                                   max_tokens=self.room(), thinking_token_budget=None, seed=seed)

    def room(self) -> int:
        """Tokens the reply may still take (max_tokens, and the context beyond the prompt
        the next stretch will have)."""
        left = self.request.max_tokens - len(self.reply)
        limit = self.row.session.target.context_limit
        if limit is not None:
            left = min(left, limit - len(self.request.prompt) - len(self.reply) - 1)
        return left

    def show(self, part: Stats | None, finish: str | None):
        request, runs = self.request, self.parts + ([part] if part is not None else [])
        merged = Stats.total(runs) if runs else Stats(requested=request.speculative)
        merged.prompt_tokens = len(request.prompt)
        merged.reused_tokens = runs[0].reused_tokens if runs else 0
        merged.generated, merged.generations = len(self.reply), max(1, len(runs))
        merged.finish_reason = finish
        merged.finish_detail = None if finish != "length" else \
            "max_tokens" if len(self.reply) >= request.max_tokens else "context"
        if request.logprobs is not None:
            self.runs = runs
            merged.scoring = weakref.WeakMethod(self.scored)
            merged.logprobs = self.scored() if finish is not None else None
        vars(self.stats).update(vars(merged))

    def scored(self) -> list[tuple]:
        """The reply's logprobs so far: its stretches' (the closing ids' with the last
        stretch's), or the closing ids' scores when they ended it."""
        return [s for run in self.runs for s in run.scores() or ()] + self.written

    def _score_written(self) -> list[tuple]:
        """The closing ids that end the reply, scored by the forward the next stretch would
        have begun with: its prefill of them on the row's own session."""
        session, written = self.row.session, len(self.reply) - sum(p.generated for p in self.parts)
        prompt = list(self.request.prompt) + self.reply
        reuse(session, prompt, written)
        rows = to_the_end(prefill_steps(session, prompt, session.drafter is not None,
                                        scored=written))
        return read_scores([(prompt[-written:],
                             log_probs(rows[:-1], mx.array(prompt[-written:]),
                                       self.request.logprobs))])


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(seq[i:i + n]) == sub for i in range(len(seq) - n + 1))
