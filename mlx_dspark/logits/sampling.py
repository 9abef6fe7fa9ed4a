"""Turning logits into a distribution and drawing from it.

The target and the drafter must warp logits *identically* (temperature, then top-k, then
top-p): both acceptance schemes compare the two warped distributions.

Every draw is a Gumbel-max draw, ``argmax(log p + g)`` with standard Gumbel noise ``g``; greedy
decoding is the case ``g = 0``. Two schemes choose the noise (docs/design.md §7, docs/sampling.md):

* ``reproducible``: ``g`` of the token at absolute position ``t`` is fixed by (seed, t), and
  the drafter proposes with the *same* noise. A draft is accepted while it equals the target's
  own Gumbel-max token, so every emitted token is the one serial decoding would emit with that
  seed: the text does not depend on the drafter, ``num_draft`` or the controller.
* ``rejection``: fresh noise per round and speculative rejection sampling (Leviathan et al.
  2023): accepts more drafts, reproduces only in distribution."""

from __future__ import annotations

import math
import os
import mlx.core as mx

from ..request import Sampler
from .processors import blame


def choose(sampler: Sampler, logits: mx.array, noise: mx.array | None) -> mx.array:
    """The token of each row of ``logits`` given its Gumbel noise (None when greedy). A
    user's sampler's id outside the vocabulary comes back as the code that blames it
    (processors.blame; run.finite names it)."""
    if sampler.custom is not None:
        logp = mask_vocab(logits.astype(mx.float32), sampler.vocab)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
        tokens = mx.concatenate([as_token(sampler.custom(logp[i:i + 1]))
                                 for i in range(logp.shape[0])]).astype(mx.int64)
        return mx.where((tokens >= 0) & (tokens < logits.shape[-1]), tokens,
                        blame("sampler")).astype(mx.int32)
    return gumbel_max(logits, sampler.temperature, sampler.top_p, sampler.top_k, noise,
                      sampler.vocab, sampler.min_p, sampler.min_tokens_to_keep)


def warped(sampler: Sampler, logits: mx.array) -> mx.array:
    """The distribution ``sampler`` draws from (:func:`warp` with its values)."""
    return warp(logits, sampler.temperature, sampler.top_p, sampler.top_k, sampler.vocab,
                sampler.min_p, sampler.min_tokens_to_keep)


def as_token(value) -> mx.array:
    """A user sampler's answer (an array or an int) as one token ``[1]``, in its own type
    (an id past int32 is not wrapped into the vocabulary: :func:`choose` checks it)."""
    token = value if isinstance(value, mx.array) else mx.array(value)
    return token.reshape(1)


class Noise:
    """The Gumbel noise of one decode call: by absolute position ("reproducible"), fresh from
    a key split per use ("rejection"), or none (greedy)."""

    def __init__(self, sampler: Sampler, seed: int | None):
        if seed is None:          # else in [0, 2**64) (request.Request reduces it)
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = seed          # the one used, given or drawn (Stats.seed)
        self.sampler = sampler
        self.word = seed_word(seed)
        self.key = mx.random.key(seed)

    def next_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def at(self, start: int, n: int, vocab: int) -> mx.array | None:
        """Noise ``[n, vocab]`` for the tokens at positions start..start+n-1."""
        if not self.sampler.noisy:
            return None
        if self.sampler.scheme == "reproducible":
            return position_noise(self.word, start, n, vocab)
        return mx.random.gumbel((n, vocab), key=self.next_key())


def mask_vocab(logits: mx.array, vocab: int | None) -> mx.array:
    """``logits`` with ids at or above ``vocab`` set to -inf (a model whose embedding is
    padded past its tokenizer: such ids cannot be decoded, so they are never meant)."""
    if vocab is None or vocab >= logits.shape[-1]:
        return logits
    return mx.where(mx.arange(logits.shape[-1]) < vocab, logits, -mx.inf)


def log_warp(logits: mx.array, temperature: float, top_p: float = 1.0,
             top_k: int = 0, vocab: int | None = None, min_p: float = 0.0,
             min_tokens_to_keep: int = 1) -> mx.array:
    """Log-probabilities (float32, last axis) after min-p, temperature, top-k and top-p;
    excluded tokens are -inf. ``temperature > 0``. The largest logit is subtracted before
    dividing and the maxima are kept at 0, so a tiny temperature (1e-300 is 0 in float32)
    gives the limit (mass spread over the tied maxima, -inf elsewhere) instead of 0 / 0.

    ``min_p`` is mlx-lm's: a token stays when its probability *before* temperature is at
    least ``min_p`` times the most likely one's (and the ``min_tokens_to_keep`` most likely
    stay whatever their probability); the set does not depend on the temperature."""
    z = mask_vocab(logits.astype(mx.float32), vocab)
    z = z - z.max(axis=-1, keepdims=True)
    if min_p > 0:
        keep = z >= math.log(min_p)
        if min_tokens_to_keep > 1:
            kth = mx.sort(z, axis=-1)[..., -min(min_tokens_to_keep, z.shape[-1])][..., None]
            keep = keep | (z >= kth)
        z = mx.where(keep, z, -mx.inf)
    z = mx.where(z < 0, z / temperature, z)
    if top_k and top_k < z.shape[-1]:
        kth = mx.sort(z, axis=-1)[..., -top_k][..., None]
        z = mx.where(z < kth, -mx.inf, z)
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p
        # (a token is kept when the mass strictly before it is < top_p; the most likely
        # always, so a top_p below float32's range, 1e-300, is the most likely token).
        probs = mx.exp(logp)
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = (before < top_p) | (mx.arange(z.shape[-1]) == 0)
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logp = mx.where(keep, logp, -mx.inf)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    return logp


def warp(logits: mx.array, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
         vocab: int | None = None, min_p: float = 0.0, min_tokens_to_keep: int = 1) -> mx.array:
    """Probabilities (float32, last axis) after min-p, temperature, top-k and top-p; ids from
    ``vocab`` on have none.

    ``temperature == 0`` gives the one-hot of the argmax (ties: lowest index)."""
    if temperature == 0:
        best = mx.argmax(mask_vocab(logits, vocab), axis=-1, keepdims=True)
        return (mx.arange(logits.shape[-1]) == best).astype(mx.float32)
    return mx.exp(log_warp(logits, temperature, top_p, top_k, vocab, min_p,
                           min_tokens_to_keep))


def log_probs(rows: mx.array, tokens: mx.array, top: int):
    """Lazy ``(logprob of each token, its row's ``top`` most likely ids, their logprobs)``
    under the raw ``rows`` [n, V] (no temperature, top-p, top-k or mask)."""
    logp = rows.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    order = mx.argsort(-logp, axis=-1)[:, :top]
    return chosen, order, mx.take_along_axis(logp, order, axis=-1)


def constrain(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """``logits`` with the tokens a grammar forbids (``allowed`` false, broadcast over rows)
    at ``-inf``, before any warping; ``None`` leaves them as they are. Target and drafter
    apply the same masks, so both acceptance schemes stay exact."""
    return logits if allowed is None else mx.where(allowed, logits, -mx.inf)


def gumbel_max(logits: mx.array, temperature: float, top_p: float, top_k: int,
               noise: mx.array | None, vocab: int | None = None, min_p: float = 0.0,
               min_tokens_to_keep: int = 1) -> mx.array:
    """The token of each row: ``argmax(log warp(logits) + noise)``; ``noise=None`` (greedy)
    is the plain argmax. Never an id from ``vocab`` on."""
    if noise is None:
        return mx.argmax(mask_vocab(logits, vocab), axis=-1)
    return mx.argmax(log_warp(logits, temperature, top_p, top_k, vocab, min_p,
                              min_tokens_to_keep) + noise, axis=-1)


def seed_word(seed: int) -> int:
    """The 32-bit key word of a seed (any int): splitmix64's finaliser, so nearby seeds give
    unrelated words."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def position_noise(word: int, start: int, n: int, vocab: int) -> mx.array:
    """Gumbel noise ``[n, vocab]`` of the tokens at absolute positions start..start+n-1: row
    ``j`` is drawn with the threefry key ``(word, start + j)``, so it depends on the position
    only, never on how positions are grouped into steps or rounds."""
    keys = mx.stack([mx.full((n,), word, dtype=mx.uint32),
                     mx.arange(start, start + n).astype(mx.uint32)], axis=1)
    return mx.vmap(lambda k: mx.random.gumbel((vocab,), key=k))(keys)


# ---------------------------------------------------------------------------------------------
# Acceptance (docs/design.md §7 step 3). Both functions take the drafts ``[N]`` and return lazy
# ``(a, token)``: the number of drafts accepted (0..N) and the token that follows them, so a
# round can verify lazy drafts and read everything back once.


def accept_coupled(drafts: mx.array, target_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Accept ``d_j`` while it equals the target's own token at its position
    (``target_tokens [N+1]``, Gumbel-max with the drafter's noise, or argmax when greedy); the
    token after the accepted run is the target's, so the output is serial decoding's."""
    n = drafts.shape[0]
    a = mx.cumprod((drafts == target_tokens[:n]).astype(mx.int32)).sum()
    return a, target_tokens[a]


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``normalize(max(0, p - q))`` per row: what to draw from after rejecting a draft.

    Where ``p <= q`` everywhere (only possible when p == q) a rejection has probability 0; the
    row falls back to ``p`` so it stays a valid distribution."""
    r = mx.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, r / mx.maximum(mass, 1e-30), p)


def accept_rejection(drafts: mx.array, p: mx.array, q: mx.array,
                     key) -> tuple[mx.array, mx.array]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    ``p`` is ``[N+1, V]`` (warped target), ``q`` is ``[N, V]`` (warped draft, the distribution
    each draft was drawn from). Draft ``d_j`` is accepted with probability
    ``min(1, p_{j-1}(d_j) / q_j(d_j))``; the first rejection draws from ``residual``, full
    acceptance draws the bonus from ``p_N``. The emitted tokens are distributed exactly as
    sampling from ``p`` one token at a time. The residual rows of every position are drawn at
    once and the one at ``a`` is kept."""
    n = drafts.shape[0]
    k_accept, k_draw = mx.random.split(key)
    d = drafts[:, None]
    p_d = mx.take_along_axis(p[:n], d, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    accepted = (u * q_d < p_d).astype(mx.int32)   # u < p/q without dividing by q
    rows = mx.concatenate([residual(p[:n], q), p[n:]], axis=0)
    next_tokens = mx.random.categorical(mx.log(rows), key=k_draw)
    a = mx.cumprod(accepted).sum()
    return a, next_tokens[a]
