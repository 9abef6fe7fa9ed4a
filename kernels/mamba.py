"""Mamba-2 in plain MLX: causal depthwise conv, the serial SSM recurrence and the chunked
(SSD) scan. Everything here computes in float32.

Shapes: ``b`` batch, ``t`` positions, ``h`` heads, ``p`` head dim, ``g`` groups, ``n`` state.
``x (b,t,h,p)``, ``dt (b,t,h)`` (already ``softplus(dt + dt_bias)`` and clipped),
``A (h,)`` (negative), ``B, C (b,t,g,n)``, ``D (h,)``, ``state (b,h,p,n)``.

Exact rollback (docs/design.md §5.2) rests on one property: :func:`ssm_step` is the only code that
advances the state one position, and both decoding steps, verify and the replay after a
partial acceptance go through it with identical inputs, so a replayed state is bit-identical
to the state a serial run would have reached.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .norm import FUSED_ROWS


def discretize_dt(dt_raw: mx.array, dt_bias: mx.array, limit: tuple[float, float]) -> mx.array:
    """``clip(softplus(dt + dt_bias), *limit)`` in float32. Compiled for short inputs, as the
    conv: its elementwise ops fuse."""
    fn = _discretize_compiled if dt_raw.shape[1] <= FUSED_ROWS else _discretize
    return fn(dt_raw, dt_bias, limit)


def _discretize(dt_raw, dt_bias, limit):
    dt = nn.softplus(dt_raw.astype(mx.float32) + dt_bias)
    lo, hi = limit
    if lo > 0.0 or hi != float("inf"):
        dt = mx.clip(dt, lo, hi)
    return dt


def causal_conv(padded: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """Depthwise causal conv over ``padded (b, K-1+t, c)`` with ``weight (c, K)``.

    Written as a fixed-order sum of K shifted products so that the value at a position
    depends only on its own window, never on how many positions are computed together.
    Compiled (one fused kernel, the same for a step and a verify) up to ``FUSED_ROWS``
    positions; compiled graphs are cached per shape, so a prompt of any length runs the same
    operations uncompiled (bit-identical, as kernels.norm) rather than compile anew."""
    short = padded.shape[1] - (weight.shape[1] - 1) <= FUSED_ROWS
    if bias is None:
        return (_conv_compiled if short else _conv)(padded, weight)
    return (_conv_bias_compiled if short else _conv_bias)(padded, weight, bias)


def _conv(padded, weight):
    k = weight.shape[1]
    t = padded.shape[1] - (k - 1)
    out = padded[:, 0:t] * weight[:, 0]
    for i in range(1, k):
        out = out + padded[:, i:i + t] * weight[:, i]
    return out


def _conv_bias(padded, weight, bias):
    return _conv(padded, weight) + bias


_discretize_compiled = mx.compile(_discretize)
_conv_compiled = mx.compile(_conv)
_conv_bias_compiled = mx.compile(_conv_bias)


def _per_head(v: mx.array, heads: int) -> mx.array:
    """Broadcast group tensors ``(..., g, n)`` to heads ``(..., h, n)`` (heads of a group
    are contiguous, as in HF and mlx-lm)."""
    return mx.repeat(v, heads // v.shape[-2], axis=-2)


@mx.compile
def ssm_step(state, x, dt, A, B, C):
    """One position. ``x (b,h,p)``, ``dt (b,h)``, ``B, C (b,g,n)`` -> ``(y (b,h,p), state)``.
    ``y`` excludes the ``D`` skip. Compiled: its elementwise ops fuse into one kernel (fewer
    launches per token), and every path (step, verify, replay) runs the same fused kernel, so
    the bit-identical replay still holds."""
    h = x.shape[1]
    dA = mx.exp(dt * A)
    Bh = _per_head(B, h)
    state = state * dA[..., None, None] + (x * dt[..., None])[..., None] * Bh[:, :, None, :]
    y = (state @ _per_head(C, h)[..., None])[..., 0]
    return y, state


def ssm_serial(state, x, dt, A, B, C, D):
    """The recurrence position by position. Returns ``(y (b,t,h,p), final state)``."""
    ys = []
    for i in range(x.shape[1]):
        y, state = ssm_step(state, x[:, i], dt[:, i], A, B[:, i], C[:, i])
        ys.append(y)
    y = mx.stack(ys, axis=1) + x * D[:, None]
    return y, state


def ssm_replay(state, x, dt, A, B, C):
    """Advance ``state`` over recorded positions with :func:`ssm_step` (outputs dropped)."""
    for i in range(x.shape[1]):
        _, state = ssm_step(state, x[:, i], dt[:, i], A, B[:, i], C[:, i])
    return state


def _segsum(a: mx.array) -> mx.array:
    """``out[..., i, j] = sum_{j < k <= i} a[..., k]`` for ``i >= j``, ``-inf`` above the
    diagonal. Summing the masked terms (instead of differencing a cumsum) avoids
    cancellation when the cumulative decay is large."""
    q = a.shape[-1]
    rep = mx.repeat(a[..., None], q, axis=-1)                  # [..., k, j] = a_k
    rep = mx.tril(rep, -1)                                      # keep k > j
    out = mx.cumsum(rep, axis=-2)                               # [..., i, j]
    keep = mx.tril(mx.ones((q, q), dtype=mx.bool_))
    return mx.where(keep, out, -mx.inf)


def ssm_chunked(state, x, dt, A, B, C, D, chunk: int = 128):
    """The SSD form: quadratic attention-like product inside chunks of ``chunk`` positions,
    the recurrence between chunks. Same result as :func:`ssm_serial` up to rounding."""
    b, t, h, p = x.shape
    n = B.shape[-1]
    if state is None:
        state = mx.zeros((b, h, p, n), dtype=mx.float32)
    ys = []
    for s in range(0, t, chunk):
        xc, dtc = x[:, s:s + chunk], dt[:, s:s + chunk]
        Bh = _per_head(B[:, s:s + chunk], h).transpose(0, 2, 1, 3)   # (b,h,q,n)
        Ch = _per_head(C[:, s:s + chunk], h).transpose(0, 2, 1, 3)   # (b,h,q,n)
        dtA = (dtc * A).transpose(0, 2, 1)                            # (b,h,q)
        dtx = (xc * dtc[..., None]).transpose(0, 2, 1, 3)             # (b,h,q,p)
        decay = mx.exp(_segsum(dtA))                                  # (b,h,q,q)
        y = ((Ch @ Bh.swapaxes(-1, -2)) * decay) @ dtx                # within the chunk
        y = y + (Ch @ state.swapaxes(-1, -2)) * mx.exp(mx.cumsum(dtA, axis=-1))[..., None]
        to_end = decay[:, :, -1, :]                                   # exp(sum_{j<k<=last})
        state = state * mx.exp(dtA.sum(axis=-1))[..., None, None] \
            + (dtx * to_end[..., None]).swapaxes(-1, -2) @ Bh
        ys.append(y.transpose(0, 2, 1, 3))
    y = mx.concatenate(ys, axis=1) + x * D[:, None]
    return y, state
