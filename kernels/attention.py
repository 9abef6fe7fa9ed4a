"""Causal sliding-window attention with per-head attention sinks (the DSpark drafter's).

A sink is a learned per-head logit that joins the softmax denominator without a value
vector (gpt-oss convention): ``p_i = exp(s_i) / (exp(sink_h) + sum_j exp(s_j))``. It lets a
head attend "nowhere" instead of being forced onto the visible keys.

``mx.fast.scaled_dot_product_attention(..., sinks=...)`` implements exactly this on every
backend (its CPU fallback matches a float64 brute force to 4e-7 in fp32, see
tests/test_drafter_attention.py), so it is used as is; only the mask is ours.
"""

from __future__ import annotations

import mlx.core as mx


def window_mask(q_pos: mx.array, k_pos: mx.array, window: int | None,
                causal: bool = True) -> mx.array:
    """Boolean ``[Tq, Tk]``: query at position ``q`` sees key ``k`` iff ``k <= q`` and ``k`` is
    among the last ``window`` positions up to and including ``q`` (``q - window < k``).
    ``window=None`` is plain causal attention. ``causal=False`` (a DFlash block) also lets a
    query see the keys after it, within ``window`` of it (``k < q + window``)."""
    q = q_pos[:, None]
    k = k_pos[None, :]
    visible = k <= q if causal else mx.full((q_pos.size, k_pos.size), True)
    if window is not None:
        visible = visible & (k > q - window)
        if not causal:
            visible = visible & (k < q + window)
    return visible


def sink_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                   mask: mx.array, sinks: mx.array | None) -> mx.array:
    """``q [B, Hq, Tq, D]``, ``k, v [B, Hkv, Tk, D]`` (GQA: ``Hq`` a multiple of ``Hkv``, not
    pre-tiled), boolean ``mask [Tq, Tk]``, ``sinks [Hq]`` or None. Every query must see at
    least one key (a causal window always contains the query's own key)."""
    if sinks is not None:
        sinks = sinks.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
