"""NVIDIA's DSpark drafter (``Qwen3DSparkModel``) over the converted checkpoint layout.

One drafting round (docs/design.md §6), with ``P`` = number of context tokens:

1. Context injection: each committed token ``p`` contributes ``c_p = RMSNorm(fc(taps_p))``
   and, per layer, ``K = RoPE_p(k_norm(W_k c_p))`` and ``V = W_v c_p`` to that layer's cache.
   Context never runs through the layers, and only the keys a future query can still see
   (the last ``window - 1``) are kept, so memory is O(window) whatever the context length.
2. The block ``[bonus, mask x N]`` at positions ``P..P+N`` runs through Qwen3-style layers
   (q/k RMSNorm before rotate-half RoPE, GQA, causal sliding-window attention with per-head
   sinks, SwiGLU) against the cached context keys plus its own keys.
3. Rows ``1..N`` go through the final norm and the *target's* lm_head: ``U_j``.
4. Markov head, left to right: ``z_j = U_j + W2 W1[prev]`` with ``prev`` = bonus, then
   ``d_j``; ``d_j`` is drawn from ``sampling.warp(z_j)`` (argmax at temperature 0).

After loading, the weight-load gate compares every tensor the model holds with the bytes in
the checkpoint file, read again by an independent parser, and refuses to run on a mismatch.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.integrity import check_checkpoint
from ..converter.layout import LAYOUT
from ..decode.sampling import constrain, gumbel_max
from ..decode.session import OwnCache
from ..kernels.attention import sink_attention, window_mask
from ..kernels.norm import FUSED_ROWS, rms_norm
from ..models.nemotron_h import compute_dtype
from ..models.quant import Weights
from ..models.weights import _embedding_identical, read_weights, shared_embedding, through_gate
from .config import DrafterConfig, DrafterError, check_fits, check_tensors, parse_config


# --------------------------------------------------------------------------------------------
# Model


# On the CPU mx.fast.rope falls back to a chain of primitives; compiled (for the shapes that
# recur, as kernels.norm), its elementwise parts fuse. The position is an array, so that a new
# position does not compile anew.
_rope = mx.compile(lambda x, dims, base, offset: mx.fast.rope(
    x, dims, traditional=False, base=base, scale=1.0, offset=offset))


class Norm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, w: Weights, p: str, window):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            w.linear(f"{p}.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm = Norm(w.cast(f"{p}.q_norm.weight"), cfg.rms_norm_eps)
        self.k_norm = Norm(w.cast(f"{p}.k_norm.weight"), cfg.rms_norm_eps)
        if cfg.attention_sinks:
            self.attention_sink_bias = w.cast(f"{p}.attention_sink_bias")
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.window = window

    def _heads(self, x, n, norm, pos0):
        """[1, T, n*D] -> per-head RMSNorm (if any), then RoPE -> [1, n, T, D]."""
        x = x.reshape(1, x.shape[1], n, self.head_dim)
        if norm is not None:
            x = norm(x)
        x = x.transpose(0, 2, 1, 3)
        if norm is None:
            return x
        if x.shape[2] <= FUSED_ROWS:
            return _rope(x, self.head_dim, self.theta, mx.array(pos0, dtype=mx.int32))
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.theta, scale=1.0,
                            offset=pos0)

    def context_kv(self, c, pos0):
        """Keys and values of context features ``c [1, T, hidden]`` at positions pos0.."""
        return (self._heads(self.k_proj(c), self.kv_heads, self.k_norm, pos0),
                self._heads(self.v_proj(c), self.kv_heads, None, pos0))

    def __call__(self, x, pos0, ctx_k, ctx_v, mask):
        q = self._heads(self.q_proj(x), self.heads, self.q_norm, pos0)
        k, v = self.context_kv(x, pos0)
        k = mx.concatenate([ctx_k, k], axis=2)
        v = mx.concatenate([ctx_v, v], axis=2)
        sinks = self.attention_sink_bias if "attention_sink_bias" in self else None
        o = sink_attention(q, k, v, scale=self.head_dim ** -0.5, mask=mask, sinks=sinks)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(1, x.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, w: Weights, p: str):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            w.linear(f"{p}.{n}") for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg, w: Weights, i):
        super().__init__()
        p = f"layers.{i}"
        self.input_layernorm = Norm(w.cast(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.post_attention_layernorm = Norm(w.cast(f"{p}.post_attention_layernorm.weight"),
                                             cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", cfg.windows[i])
        self.mlp = MLP(w, f"{p}.mlp")
        self._ffn = mx.compile(self._residual_mlp)    # a block's shape is fixed for an n

    def _residual_mlp(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, pos0, ctx_k, ctx_v, mask):
        return self._ffn(x + self.self_attn(self.input_layernorm(x), pos0, ctx_k, ctx_v, mask))


DRAW_SETTINGS = 8   # sampling settings whose compiled draws are kept (the most recent)


class CompiledPerKey:
    """``mx.compile(fn)`` once per key, the ``keep`` most recently used kept. MLX caches a
    compiled graph per value of each non-array argument (a request's temperature), for as long
    as the compiled function lives: one per key, dropped when evicted, bounds what a server
    that sees a new setting in every request holds."""

    def __init__(self, fn, keep: int):
        self.fn, self.keep = fn, keep
        self.compiled: OrderedDict = OrderedDict()

    def __call__(self, key, *args):
        fn = self.compiled.pop(key, None) or mx.compile(self.fn)
        self.compiled[key] = fn
        if len(self.compiled) > self.keep:
            self.compiled.popitem(last=False)
        return fn(*args)


class MarkovHead(nn.Module):
    """``bias(prev) = W2 · W1[prev]``; computed in fp32 whatever the model dtype, because each
    drawn token feeds the next step."""

    def __init__(self, w: Weights):
        super().__init__()
        self.markov_w1 = nn.Module()
        self.markov_w1.weight = w["markov_head.markov_w1.weight"]  # kept in its stored dtype
        self.markov_w2 = w.linear("markov_head.markov_w2", mx.float32)

    def __call__(self, prev):
        return self.markov_w2(self.markov_w1.weight[prev].astype(mx.float32))


class Drafter(OwnCache, nn.Module):
    """Parameter names mirror the checkpoint's tensor names (the weight-load gate relies on it)."""

    def __init__(self, cfg: DrafterConfig, w: dict, target, dtype, share_embedding: bool,
                 nvfp4: str | None = None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        w = Weights(w, dtype, nvfp4)
        self.fc = w.linear("fc")
        self.hidden_norm = Norm(w.cast("hidden_norm.weight"), cfg.rms_norm_eps)
        self.layers = [Layer(cfg, w, i) for i in range(cfg.num_layers)]
        self.norm = Norm(w.cast("norm.weight"), cfg.rms_norm_eps)
        self.markov_head = MarkovHead(w)
        self._draws = CompiledPerKey(self._markov_draws, DRAW_SETTINGS)
        if not share_embedding:
            self.embed_tokens = nn.Module()
            self.embed_tokens.weight = w["embed_tokens.weight"]  # stored dtype; rows cast on use
        # Borrowed lm_head (and embedding). Set around nn.Module's attribute hook so the
        # target is neither a parameter nor a child module of the drafter.
        object.__setattr__(self, "_target", target)
        self.gate_report = None

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def max_draft(self) -> int:
        """Most tokens one ``propose`` drafts: the block holds the bonus and the drafts."""
        return self.config.block_size - 1

    def _embed(self, ids):
        if "embed_tokens" in self:
            return self.embed_tokens.weight[ids].astype(self.dtype)
        return self._target.embed(ids).astype(self.dtype)

    @property
    def context_keep(self) -> int | None:
        """Context rows any future query can still attend: with every layer windowed, tokens
        older than the widest window never are again (None: some layer sees everything)."""
        windows = self.config.windows
        return None if None in windows else max(windows) - 1

    def make_cache(self, start: int = 0) -> "DrafterCache":
        """An empty context, owned by whoever decodes with it (a session). ``start``: the
        position of its first token, when the tokens before it are too old to matter
        (older than :attr:`context_keep`)."""
        cache = DrafterCache(len(self.layers), self.config.num_kv_heads, self.config.head_dim,
                             self.dtype)
        cache.length = start
        return cache

    @property
    def length(self) -> int:
        """Context tokens in the drafter's own cache."""
        return self._cache(None).length

    def shared_embedding(self) -> mx.array:
        return shared_embedding(self._target, self.config.vocab_size)

    def add_context(self, taps: mx.array, start_pos: int, cache: "DrafterCache | None" = None,
                    tokens=None):
        """Commit taps ``[T, n_taps*hidden]`` of the tokens at positions start_pos.. to
        ``cache`` (default: the drafter's own). DSpark reads the taps alone (``tokens``
        unused)."""
        cache = self._context(cache, taps, start_pos, self.config.hidden_size
                              * len(self.config.target_layer_ids), tokens=False)
        # Skip what no future query attends: a long prompt or serial stretch costs a window.
        keep = self.context_keep
        if keep and taps.shape[0] > keep:
            skip = taps.shape[0] - keep
            taps, start_pos = taps[skip:], start_pos + skip
        c = self.hidden_norm(self.fc(taps.astype(self.dtype)))[None]
        layers = []
        for layer, (ck, cv) in zip(self.layers, cache.layers):
            k, v = layer.self_attn.context_kv(c, start_pos)
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
            window = layer.self_attn.window
            if window is not None:
                # The earliest future query (position `length`) sees keys > length - window.
                start = max(0, k.shape[2] - (window - 1))
                k, v = k[:, :, start:], v[:, :, start:]
            layers.append((k, v))
        # New arrays, never writes into the old ones: a snapshot of the cache stays valid.
        cache.layers = tuple(layers)
        cache.length = start_pos + taps.shape[0]     # the skipped tokens count too

    def block_logits(self, bonus, n: int, cache: "DrafterCache | None" = None) -> mx.array:
        """``U [n, V]``: the target's lm_head over rows 1..n of the block (before Markov)."""
        cfg = self.config
        cache = self._cache(cache)
        length = cache.length
        ids = mx.concatenate([mx.array(bonus, dtype=mx.int32).reshape(1),
                              mx.full((n,), cfg.mask_token_id, dtype=mx.int32)])
        x = self._embed(ids)[None]
        q_pos = mx.arange(length, length + n + 1)
        masks = {}       # layers with the same window and context share one mask
        for layer, (ck, cv) in zip(self.layers, cache.layers):
            key = (ck.shape[2], layer.self_attn.window)
            if key not in masks:
                k_pos = mx.arange(length - ck.shape[2], length + n + 1)
                masks[key] = window_mask(q_pos, k_pos, layer.self_attn.window)
            x = layer(x, length, ck, cv, masks[key])
        h = self.norm(x[0, 1:])
        return self._target.lm_head(h).astype(mx.float32)

    def propose(self, bonus, n: int, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, noise: mx.array | None = None,
                cache: "DrafterCache | None" = None, constraint=None,
                vocab: int | None = None):
        """Draft ``n`` tokens after ``bonus``, which sits at the position after ``cache``'s
        context (default: the drafter's own cache).

        ``d_j = argmax(log warp(z_j) + noise[j-1])`` (``sampling.gumbel_max``): with Gumbel
        noise ``[n, V]`` a sample from the warped draft distribution, without (greedy) the
        argmax. Returns lazy ``tokens [n]`` and ``logits [n, V]``: the Markov-corrected logits
        each token was drawn from (warp them with ``sampling.warp`` for the distribution).

        ``constraint(j, prev)`` (a grammar, grammar.Constraint.drafting): the allowed tokens
        of row ``j`` given the token drawn before it; the row is drawn from its logits masked
        (sampling.constrain), and the masked logits are returned."""
        if not 1 <= n < self.config.block_size:
            raise ValueError(f"n={n}: this drafter drafts 1..{self.config.block_size - 1} "
                             f"tokens (block_size {self.config.block_size})")
        u = self.block_logits(bonus, n, cache)
        prev = mx.array(bonus, dtype=mx.int32).reshape(1)
        if constraint is not None:     # reads each draft back: not compiled
            return self._markov_draws(u, prev, noise, temperature, top_p, top_k, vocab,
                                      constraint)
        return self._draws((temperature, top_p, top_k, vocab), u, prev, noise, temperature,
                           top_p, top_k, vocab)

    def _markov_draws(self, u, prev, noise, temperature, top_p, top_k, vocab,
                      constraint=None):
        """The Markov loop over ``u [n, V]`` (:meth:`block_logits`): each row corrected by
        the token drawn before it. Compiled as ``_draws`` (its shapes are fixed for an n)."""
        tokens, logits = [], []
        for j in range(u.shape[0]):
            z = u[j:j + 1] + self.markov_head(prev)
            if constraint is not None:
                z = constrain(z, constraint(j, prev))
            g = None if noise is None else noise[j:j + 1]
            prev = gumbel_max(z, temperature, top_p, top_k, g, vocab).astype(mx.int32)
            tokens.append(prev)
            logits.append(z)
        return mx.concatenate(tokens), mx.concatenate(logits)


class DrafterCache:
    """The drafter's context: per layer the keys and values of the committed tokens a future
    query can still see, and ``length``, the context tokens seen (skipped ones included).

    Made by :meth:`Drafter.make_cache` and owned by a session, as the target's cache is.
    ``add_context`` replaces the arrays and never writes into them, so a snapshot is the
    references themselves, valid while the cache goes on."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype):
        empty = mx.zeros((1, kv_heads, 0, head_dim), dtype)
        self.layers = tuple((empty, empty) for _ in range(num_layers))
        self.length = 0

    def snapshot(self):
        """This state, for :meth:`restore` (lazy arrays: evaluating it computes a pending
        catch-up)."""
        return self.length, self.layers

    def restore(self, state):
        self.length, self.layers = state

    def arrays(self) -> list[mx.array]:
        return [x for kv in self.layers for x in kv]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())


# --------------------------------------------------------------------------------------------
# Loading


def load_drafter(path: str, target, dtype=None, nvfp4: str | None = None,
                 verbose: bool = False, verify: str = "auto") -> Drafter:
    """Load a converted DSpark drafter for ``target`` and pass it through the weight-load gate.

    ``dtype`` is the compute dtype or its name (None: the target's ``dtype`` attribute if it has
    one, else float32). ``nvfp4`` picks the NVFP4 compute path as for the target
    (quant.nvfp4_policy when None). The drafter borrows the target's lm_head, and its embedding
    when the drafter's own copy is bit-identical to it. ``verify``: how much of the files is
    checked against the conversion receipt first (checkpoint/integrity.py); a drafter without a receipt
    needs ``"none"``."""
    cfg_file = os.path.join(path, "config.json")
    try:
        with open(cfg_file) as fh:
            raw = json.load(fh)
    except OSError as e:
        raise DrafterError(f"{cfg_file}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise DrafterError(f"{cfg_file}: not valid JSON ({e})") from None
    quant = raw.get("quantization") or {}
    if quant.get("layout") != LAYOUT:
        raise DrafterError(f"{cfg_file}: not a converted checkpoint (no quantization.layout "
                           f"{LAYOUT!r}); run `mlx-dspark convert` on it first")
    try:
        cfg = parse_config(raw, cfg_file)
    except KeyError as e:
        raise DrafterError(f"{cfg_file}: missing field {e}") from None
    check_fits(cfg, target, cfg_file)
    if dtype is None:
        dtype = getattr(target, "dtype", None) or mx.float32
    dtype = compute_dtype(dtype)

    check_checkpoint(path, verify)
    weights, origin = read_weights(path)
    check_tensors(cfg, weights, origin, path, quant.get("modules") or {})
    share = (not cfg.has_embed_tokens
             or _embedding_identical(weights["embed_tokens.weight"], target))
    drafter = Drafter(cfg, weights, target, dtype, share, nvfp4)
    del weights
    return through_gate(drafter, path, verbose)
