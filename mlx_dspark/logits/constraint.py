"""What the loop's output must follow, as one object with a null form (docs/design.md §7,
"Grammars"): the loop asks every constraint the same things and never whether it has one.

    allowed(logits[, drafts])  the mask of the rows the device is computing (None: all tokens)
    drafting                   the drafter's per-row hook (None: drafts drawn unmasked)
    advance(token)             an emitted token is consumed
    settle(kept_drafts)        after verification: the accepted drafts stay, the rest roll back
    lookahead                  whether a serial step may be built before the token before it
                               is read (no mask depends on that token)

:class:`Unconstrained` is the null form; :class:`Grammatical` is a grammar's matcher
(grammar.Constraint) in this shape."""

from __future__ import annotations

import mlx.core as mx

from ..grammar.grammars import Constraint


class Unconstrained:
    """No constraint: every token is allowed and nothing is followed."""

    lookahead = True
    drafting = None       # a drafter without a hook draws its drafts in one compiled chain

    def allowed(self, logits: mx.array, drafts: mx.array | None = None):
        return None

    def advance(self, token: int):
        pass

    def settle(self, kept_drafts: int):
        pass


class Grammatical:
    """A grammar's matcher as the loop uses it: each mask is computed on the CPU while the
    device computes the logits it masks."""

    lookahead = False     # the next mask needs the token read first

    def __init__(self, matcher: Constraint):
        self.matcher = matcher
        self.drafting, self.advance, self.settle = \
            matcher.drafting, matcher.advance, matcher.settle

    def allowed(self, logits: mx.array, drafts: mx.array | None = None) -> mx.array:
        """The mask of the row after the emitted tokens, or with ``drafts`` the verify pass's
        rows after d1..di (``[n+1, V]``)."""
        mx.async_eval(logits)
        return self.matcher.mask() if drafts is None else self.matcher.verify_masks(drafts)


def of(request, vocab_size: int) -> Unconstrained | Grammatical:
    """The constraint of ``request`` (its grammar, and its stop tokens to end on)."""
    if request.grammar is None:
        return Unconstrained()
    return Grammatical(Constraint(request.grammar, request.stop_tokens, vocab_size))
