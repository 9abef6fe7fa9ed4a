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
        best = mx.argmax(logits, axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == best).astype(mx.float32)
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


# ---------------------------------------------------------------------------------------------
# Acceptance (DESIGN §7 step 3). Both functions take the drafts and return
# ``(a, token)``: the number of drafts accepted (0..N) and the token that follows them
# (the residual draw after a rejection, the bonus from p_N after full acceptance).


def accept_greedy(drafts: list[int], target_logits: mx.array) -> tuple[int, int]:
    """Greedy verification: accept ``d_j`` while it equals ``argmax p_{j-1}``.

    ``target_logits`` is ``[N+1, V]``; the token after the accepted run is the target's own
    argmax there, so the output is the serial greedy output token for token."""
    best = mx.argmax(target_logits, axis=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``normalize(max(0, p - q))`` per row: what to draw from after rejecting a draft.

    Where ``p <= q`` everywhere (only possible when p == q) a rejection has probability 0; the
    row falls back to ``p`` so it stays a valid distribution."""
    r = mx.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, r / mx.maximum(mass, 1e-30), p)


def accept_sampled(drafts: list[int], p: mx.array, q: mx.array, key) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    ``p`` is ``[N+1, V]`` (warped target), ``q`` is ``[N, V]`` (warped draft, the distribution
    each draft was drawn from). Draft ``d_j`` is accepted with probability
    ``min(1, p_{j-1}(d_j) / q_j(d_j))``; the first rejection draws from ``residual``, full
    acceptance draws the bonus from ``p_N``. The emitted tokens are distributed exactly as
    sampling from ``p`` one token at a time. Everything is computed in one evaluation: the
    residual rows for every position are drawn at once and the one at ``a`` is kept."""
    n = len(drafts)
    k_accept, k_draw = mx.random.split(key)
    d = mx.array(drafts, dtype=mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:n], d, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    accepted = u * q_d < p_d                       # u < p/q without dividing by q
    rows = mx.concatenate([residual(p[:n], q), p[n:]], axis=0)
    next_tokens = draw(rows, key=k_draw)
    mx.eval(accepted, next_tokens)
    accepted, next_tokens = accepted.tolist(), next_tokens.tolist()
    a = 0
    while a < n and accepted[a]:
        a += 1
    return a, next_tokens[a]
