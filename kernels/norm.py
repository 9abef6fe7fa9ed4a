"""RMSNorm whose CPU fallback is fused where shapes recur.

On the CPU ``mx.fast.rms_norm`` falls back to a chain of graph primitives; compiled, its
elementwise parts fuse (with bit-identical results: the same operations on each row). Compiled
graphs are cached per shape, so only inputs of up to ``FUSED_ROWS`` positions (a decoding
step, a verify, a drafter block) take the compiled path; a prompt or a catch-up of arbitrary
length runs the plain op rather than compile anew."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

FUSED_ROWS = 16

_compiled = mx.compile(mx.fast.rms_norm)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` over the last axis of ``x [B, T, ...]``."""
    norm = _compiled if x.shape[1] <= FUSED_ROWS else mx.fast.rms_norm
    return norm(x, weight, eps)


def gated_rms_norm(y: mx.array, gate: mx.array, weight: mx.array, groups: int,
                   eps: float) -> mx.array:
    """Mamba-2's gated grouped RMSNorm of ``y, gate [B, T, D]``: in float32, the weight
    applied after the cast to its dtype (as transformers)."""
    norm = _gated_compiled if y.shape[1] <= FUSED_ROWS else _gated
    return norm(y, gate, weight, groups, eps)


def _gated(y, gate, weight, groups, eps):
    b, t, d = y.shape
    y = (y * nn.silu(gate.astype(mx.float32))).reshape(b, t, groups, -1)
    y = mx.fast.rms_norm(y, None, eps).reshape(b, t, d)
    return weight * y.astype(weight.dtype)


_gated_compiled = mx.compile(_gated)
