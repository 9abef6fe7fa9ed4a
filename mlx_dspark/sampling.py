"""Turning logits into a distribution and drawing from it.

The target and the drafter must warp logits *identically* (temperature, then top-k, then
top-p), because lossless rejection sampling compares the two warped distributions."""

from __future__ import annotations

import mlx.core as mx


def warp(logits: mx.array, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> mx.array:
    """Probabilities (float32, last axis) after temperature, top-k and top-p.

    ``temperature == 0`` gives the one-hot of the argmax (ties: lowest index), so greedy
    decoding is the same code path as sampling."""
    logits = logits.astype(mx.float32)
    if temperature == 0:
        return mx.eye(logits.shape[-1], dtype=mx.float32)[mx.argmax(logits, axis=-1)]
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p
        # (a token is kept when the mass strictly before it is < top_p).
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = before < top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def draw(probs: mx.array, key=None) -> mx.array:
    """One token id per row of ``probs``."""
    return mx.random.categorical(mx.log(probs), key=key)
