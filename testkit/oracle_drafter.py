"""A drafter with a chosen acceptance rate, for the controller tests and the loop benchmark
(never used by the API).

It knows the target's greedy continuation in advance (``reference``: the prompt followed by
the serial greedy output of the same target), and at each drafted position proposes the
reference token with probability ``acceptance`` (a float, or a function of the drafted
position for content that changes), otherwise a different token. Under greedy verification
the conditional acceptance at every position is therefore ``acceptance`` exactly in
expectation, which is what the controller tests and the loop benchmark need.

It implements what the loop calls on a drafter (``target_layer_ids``, ``max_draft``,
``make_cache``, ``add_context``, ``propose``). ``inner`` (optional, a real drafter) is run alongside on every call and its
proposals thrown away, so a round costs what a real drafter's round costs; ``draft_work``
(optional, a function) is run on every proposal instead: a drafting cost the controller tests
can choose, which slows down with the machine's load like real drafting does."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from mlx_dspark.logits.draw import Draw


class OracleDrafter:
    def __init__(self, reference, vocab_size: int, acceptance=1.0, target_layer_ids=(0,),
                 inner=None, seed: int = 0, draft_work=None, max_draft: int = 7):
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.acceptance = acceptance if callable(acceptance) else (lambda pos: acceptance)
        self.inner = inner
        self.draft_work = draft_work
        self.rng = np.random.default_rng(seed)   # one stream for every cache: fresh coins per run
        self._ids = list(inner.target_layer_ids) if inner is not None else list(target_layer_ids)
        self.max_draft = inner.max_draft if inner is not None else max_draft

    @property
    def target_layer_ids(self):
        return self._ids

    @property
    def context_keep(self) -> int | None:
        return self.inner.context_keep if self.inner is not None else None

    def make_cache(self, start: int = 0) -> "OracleCache":
        cache = OracleCache(self.inner.make_cache(start) if self.inner is not None else None)
        cache.length = start
        return cache

    def add_context(self, taps: mx.array, start_pos: int, cache: "OracleCache", tokens=None):
        if start_pos != cache.length:
            raise ValueError(f"add_context at {start_pos}, but {cache.length} tokens held")
        cache.length = start_pos + taps.shape[0]
        if self.inner is not None:
            self.inner.add_context(taps, start_pos, cache.inner, tokens)

    def propose(self, bonus, n: int, draw: Draw | None = None, cache: "OracleCache" = None):
        draw = draw if draw is not None else Draw()
        constraint = draw.constraint
        if self.inner is not None:       # its cost, without the grammar's per-row reads
            mx.eval(self.inner.propose(bonus, n, replace(draw, constraint=None), cache.inner))
        if self.draft_work is not None:
            self.draft_work()
        tokens = []
        for j in range(1, n + 1):
            pos = cache.length + j
            right = self.reference[pos] if pos < len(self.reference) else 0
            if self.rng.random() < self.acceptance(pos):
                token = right
            else:
                token = (right + 1 + int(self.rng.integers(self.vocab_size - 1))) \
                    % self.vocab_size
            if constraint is not None:       # under a grammar: the first allowed token
                allowed = np.array(constraint(j - 1, mx.array(tokens[-1:] or [bonus])))
                token = token if allowed[token] else int(np.argmax(allowed))
            tokens.append(token)
        # The draft distribution is a point mass on each proposal (any warping keeps it so).
        logits = mx.full((n, self.vocab_size), -1e9, dtype=mx.float32)
        logits[mx.arange(n), mx.array(tokens)] = 0.0
        return mx.array(tokens, dtype=mx.int32), logits


class OracleCache:
    """The context length (all the oracle needs) and the inner drafter's cache."""

    def __init__(self, inner):
        self.length = 0
        self.inner = inner

    def snapshot(self):
        return self.length, self.inner.snapshot() if self.inner is not None else None

    def restore(self, state):
        self.length, inner = state
        if self.inner is not None:
            self.inner.restore(inner)

    def arrays(self) -> list:
        return self.inner.arrays() if self.inner is not None else []
