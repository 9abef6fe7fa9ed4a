"""How a drafter draws its drafts, as one object the loop hands it (:class:`Draw`): the
request's sampling (a :class:`~.sampling.Sampler`), the Gumbel noise of the drafted rows, a
grammar's per-row hook, and the logits processors with the tokens before the first draft.

Each row goes through the chain the target's rows go through, in the same order, so both
acceptance schemes stay exact: the processors (with the history up to that row: the context,
the bonus and the drafts before it), the grammar's mask, then Gumbel-max (argmax when greedy,
a user's ``sampler=`` when there is one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .processors import Processors
from .sampling import Sampler, choose, constrain, gumbel_max


@dataclass(frozen=True)
class Draw:
    """How each draft is drawn: ``sampler`` (the warping; never an id from its ``vocab`` on),
    the Gumbel noise ``[n, V]`` of the drafted rows (None: greedy, the argmax), a grammar's
    ``constraint(j, prev)`` (the allowed tokens of row ``j`` after the token ``prev``,
    grammar.Constraint.drafting; None: no grammar), and ``processors`` with ``history``, the
    tokens before the first drafted row (the context and the bonus)."""

    sampler: Sampler = field(default_factory=Sampler)
    noise: mx.array | None = None
    constraint: Callable | None = None
    processors: Processors = field(default_factory=Processors)
    history: mx.array | None = None

    @classmethod
    def of(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
           vocab: int | None = None, min_p: float = 0.0, min_tokens_to_keep: int = 1,
           noise: mx.array | None = None, constraint: Callable | None = None) -> "Draw":
        """A draw from the warping's values (``Sampler.settings``' order), for callers that
        use a drafter alone and for a compiled draw."""
        return cls(Sampler(temperature, top_p, top_k, vocab=vocab, min_p=min_p,
                           min_tokens_to_keep=min_tokens_to_keep), noise, constraint)

    @property
    def compiled(self) -> bool:
        """Whether the drafts may be drawn in one compiled chain: no grammar (it reads each
        draft back), no processors and no user sampler (Python callables)."""
        return self.constraint is None and not self.processors and self.sampler.custom is None

    @property
    def settings(self) -> tuple:
        """The options a compiled draw is specialised on (what it is cached by)."""
        return self.sampler.settings

    def __call__(self, j: int, z: mx.array, prev: mx.array,
                 before: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Row ``j``: its logits ``z [1, V]`` processed after the tokens ``before``, masked by
        the grammar after ``prev``, and the token drawn from them: ``(token [1], z as
        drawn)``."""
        z = self.processors(before, z)
        if self.constraint is not None:
            z = constrain(z, self.constraint(j, prev))
        s = self.sampler
        if s.custom is not None:     # an id out of range is drafted as 0: the target's own
            return mx.maximum(choose(s, z, None), 0), z   # row decides, and names the sampler
        g = None if self.noise is None else self.noise[j:j + 1]
        return gumbel_max(z, s.temperature, s.top_p, s.top_k, g, s.vocab, s.min_p,
                          s.min_tokens_to_keep).astype(mx.int32), z

    def chain(self, row: Callable, bonus: mx.array, n: int) -> tuple[mx.array, mx.array]:
        """The ``n`` drafts after ``bonus [1]``: ``row(j, prev)`` gives the logits ``[1, V]`` of
        draft ``j`` after the token drawn before it, which is drawn and feeds the next row.
        Lazy ``(tokens [n], logits [n, V])``, the logits each token was drawn from."""
        if self.processors and self.history is None:
            raise ValueError("a draw with processors needs the history before its first row")
        prev, tokens, logits = bonus, [], []
        for j in range(n):
            before = mx.concatenate([self.history, *tokens]) if self.processors else None
            prev, z = self(j, row(j, prev), prev, before)
            tokens.append(prev)
            logits.append(z)
        return mx.concatenate(tokens), mx.concatenate(logits)
