"""Logits processors: what changes a row of logits from the tokens before it, before the
grammar's mask and the warping (docs/sampling.md, "Penalties and processors").

A processor is mlx-lm's callable ``(tokens, logits) -> logits``: ``tokens`` the sequence
before the row (prompt and generated, a 1-D int32 array), ``logits [1, V]``. A penalty depends
on the tokens before each position, so every row gets the history up to *its* position: a
draft row the context, the bonus and the drafts before it; verify row ``i`` the context, the
bonus and d1..di. Target and drafter rows then see the same function of the same history, and
speculative decoding stays serial decoding's (greedy, "reproducible") or its distribution
("rejection").

The built-in ones: mlx-lm's ``repetition_penalty`` (the logit of a token among the last
``repetition_context_size`` tokens divided by the penalty when positive, multiplied when
negative) and OpenAI's ``presence_penalty`` / ``frequency_penalty`` (``logit -= presence *
[c > 0] + frequency * c``, ``c`` the token's count among the *generated* tokens).

A row that a processor turns unusable (a NaN, a +inf, or every token at -inf; a -inf alone
is a ban, as mlx-lm's processors write them) is blamed on the field it came from:
:meth:`Processors.checked` gives each row a negative code (:func:`blame`) that rides in the
step's one read and run.finite turns into a RequestError naming that field."""

from __future__ import annotations

import mlx.core as mx

# The fields a row's unusable logits are blamed on; "sampler": a user's sampler= that
# returned an id outside the vocabulary (sampling.choose).
BLAMED = ("logit_bias", "repetition_penalty", "frequency_penalty", "logits_processors",
          "sampler")


def blame(field: str) -> int:
    """The code a token read as a negative number carries for ``field`` (-1 is the model's
    own non-finite logits, run.finite)."""
    return -2 - BLAMED.index(field)


def usable(z: mx.array) -> mx.array:
    """Whether a row of logits can be drawn from (lazy): no NaN, no +inf, some token
    above -inf."""
    return ~mx.isnan(z).any() & ~(z == mx.inf).any() & (z > -mx.inf).any()


def counts(tokens: mx.array, vocab: int) -> mx.array:
    """How often each id occurs in ``tokens``: float32 ``[vocab]`` (ids past it, a prompt's
    media positions (models/media_rows.py), count for no token)."""
    zeros = mx.zeros((vocab + 1,), mx.float32)
    return (zeros if tokens.size == 0 else zeros.at[mx.minimum(tokens, vocab)].add(1.0))[:vocab]


def bias(pairs):
    """OpenAI's (and mlx-lm's) ``logit_bias``: ``(id, bias)`` pairs added to the logits."""
    ids = mx.array([t for t, _ in pairs], dtype=mx.int32)
    values = mx.array([b for _, b in pairs], dtype=mx.float32)

    def process(tokens, logits):
        return logits.at[:, ids].add(values)
    return process


def repetition(penalty: float, context_size: int):
    """mlx-lm's repetition penalty (CTRL, Keskar et al. 2019) over the last ``context_size``
    tokens, prompt included."""
    def process(tokens, logits):
        seen = counts(tokens[-context_size:], logits.shape[-1]) > 0
        return mx.where(seen, mx.where(logits < 0, logits * penalty, logits / penalty), logits)
    return process


def occurrence(presence: float, frequency: float, start: int):
    """OpenAI's presence and frequency penalties over the generated tokens: those at
    positions ``start`` on (the request's prompt ends before ``start``)."""
    def process(tokens, logits):
        c = counts(tokens[start:], logits.shape[-1])
        return logits - frequency * c - presence * (c > 0)
    return process


class Processors:
    """One decode call's processors: the request's logit bias and penalties, then its
    ``logits_processors`` in order, each with the field it came from (``fields``; a
    :data:`BLAMED` name, "logits_processors" when not given). Falsy when there are none (the
    loop then passes no history)."""

    def __init__(self, funcs=(), fields=None):
        self.funcs = tuple(funcs)
        self.fields = tuple(fields) if fields is not None else \
            ("logits_processors",) * len(self.funcs)
        self._held, self._array = 0, mx.zeros((0,), mx.int32)

    @classmethod
    def of(cls, request) -> "Processors":
        funcs = [(bias(request.logit_bias), "logit_bias")] if request.logit_bias else []
        if request.repetition_penalty not in (None, 1):
            funcs.append((repetition(request.repetition_penalty,
                                     request.repetition_context_size), "repetition_penalty"))
        if request.presence_penalty or request.frequency_penalty:
            funcs.append((occurrence(request.presence_penalty, request.frequency_penalty,
                                     len(request.prompt)), "frequency_penalty"))
        funcs += [(f, "logits_processors") for f in request.logits_processors]
        return cls([f for f, _ in funcs], [name for _, name in funcs])

    def __bool__(self) -> bool:
        return bool(self.funcs)

    def history(self, tokens: list[int], *more) -> mx.array | None:
        """``tokens`` (a session's, which only grows within a call: converted once, extended
        by what is new) followed by ``more`` (ints or lazy token arrays); None without
        processors."""
        if not self.funcs:
            return None
        if len(tokens) < self._held:                  # a reset session: start over
            self._held, self._array = 0, mx.zeros((0,), mx.int32)
        if len(tokens) > self._held:
            self._array = mx.concatenate([self._array, mx.array(tokens[self._held:],
                                                                dtype=mx.int32)])
            self._held = len(tokens)
        tail = [t.astype(mx.int32).reshape(-1) if isinstance(t, mx.array)
                else mx.array([t], dtype=mx.int32) for t in more]
        return mx.concatenate([self._array, *tail]) if tail else self._array

    def __call__(self, history: mx.array | None, logits: mx.array,
                 ahead: mx.array | None = None) -> mx.array:
        """``logits [k, V]`` processed row by row: row ``i`` after ``history`` and
        ``ahead[:i + 1]`` (``ahead`` None: one row, after ``history``). Unchanged without
        processors. Float32, and each function gets a row of its own (an mlx-lm processor
        may write into it)."""
        return self.checked(history, logits, ahead)[0]

    def checked(self, history: mx.array | None, logits: mx.array,
                ahead: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The processed rows (as a call) and, per row, 0 or the :func:`blame` code of the
        first processor that left it unusable (lazy int32 ``[k]``)."""
        fine = mx.zeros((logits.shape[0],), mx.int32)
        if not self.funcs:
            return logits, fine
        logits = logits.astype(mx.float32)
        rows, codes = [], []
        for i in range(logits.shape[0]):
            before = history if ahead is None else mx.concatenate([history, ahead[:i + 1]])
            z, code = logits[i:i + 1], fine[i]
            for f, field in zip(self.funcs, self.fields):
                z = f(before, z)
                code = mx.where((code == 0) & ~usable(z), blame(field), code)
            rows.append(z)
            codes.append(code)
        return mx.concatenate(rows), mx.stack(codes)
