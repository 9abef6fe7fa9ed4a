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

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from ..kernels.attention import sink_attention, window_mask
from ..kernels.norm import FUSED_ROWS
from ..models.layers import CompiledPerKey, Norm
from ..models.quant import Weights
from ..models.weights import through_gate
from .base import DrafterBase, Draw, draft_dtype, read_converted, shares_embedding
from .config import ARCHITECTURES, DrafterConfig, check_fits, check_tensors, parse_config


# --------------------------------------------------------------------------------------------
# Model


# On the CPU mx.fast.rope falls back to a chain of primitives; compiled (for the shapes that
# recur, as kernels.norm), its elementwise parts fuse. The position is an array, so that a new
# position does not compile anew.
_rope = mx.compile(lambda x, dims, base, offset: mx.fast.rope(
    x, dims, traditional=False, base=base, scale=1.0, offset=offset))


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


class BlockDrafter(DrafterBase):
    """The backbone DSpark shares with DFlash (drafters/dflash.py): context rows
    ``hidden_norm(fc(taps))`` injected as each layer's K/V, a block ``[bonus, mask x n]``
    through the layers, the final norm. A kind adds its logits and its draw; ``causal`` says
    whether a block row sees the rows after it. Parameter names mirror the checkpoint's
    tensor names (the weight-load gate relies on it)."""

    def __init__(self, cfg: DrafterConfig, w: dict, target, dtype, share_embedding: bool,
                 nvfp4: str | None = None):
        super().__init__(target, dtype, cfg, None if share_embedding else w["embed_tokens.weight"])
        w = Weights(w, dtype, nvfp4)
        self.fc = w.linear("fc")
        self.hidden_norm = Norm(w.cast("hidden_norm.weight"), cfg.rms_norm_eps)
        self.layers = [Layer(cfg, w, i) for i in range(cfg.num_layers)]
        self.norm = Norm(w.cast("norm.weight"), cfg.rms_norm_eps)

    # Whether an embed_tokens.weight the config does not declare is the drafter's own table
    # (DFlash's configs never say; an export may carry a copy) rather than a stray tensor.
    optional_embedding = False

    def causal(self, i: int) -> bool:
        """Whether layer ``i``'s block rows see only themselves and the rows before them."""
        return True

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def max_draft(self) -> int:
        """Most tokens one ``propose`` drafts: the block holds the bonus and the drafts."""
        return self.config.block_size - 1

    @property
    def tap_width(self) -> int:
        return self.config.hidden_size * len(self.config.target_layer_ids)

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

    def features(self, taps):
        """``c_p = RMSNorm(fc(taps_p))``, the rows whose keys and values each layer keeps."""
        return self.hidden_norm(self.fc(taps.astype(self.dtype)))

    def context_rows(self, c, ids, start_pos: int, cache: "DrafterCache"):
        """Each layer's K/V of the context features ``c [T, hidden]`` at positions
        start_pos.., appended to the cache's and cut to the window (no tokens are read)."""
        layers = []
        for layer, (ck, cv) in zip(self.layers, cache.layers):
            k, v = layer.self_attn.context_kv(c[None], start_pos)
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
            window = layer.self_attn.window
            if window is not None:
                # The earliest future query (position `length`) sees keys > length - window.
                start = max(0, k.shape[2] - (window - 1))
                k, v = k[:, :, start:], v[:, :, start:]
            layers.append((k, v))
        # New arrays, never writes into the old ones: a snapshot of the cache stays valid.
        cache.layers = tuple(layers)

    def block_input(self, ids) -> mx.array:
        """The block rows' embeddings ``[T, hidden]``."""
        return self._embed(ids)

    def block_hidden(self, bonus, n: int, cache: "DrafterCache | None" = None) -> mx.array:
        """Rows 1..n of the block ``[bonus, mask x n]`` after the layers and the final norm:
        ``[n, hidden]``."""
        cfg = self.config
        cache = self._cache(cache)
        length = cache.length
        ids = mx.concatenate([mx.array(bonus, dtype=mx.int32).reshape(1),
                              mx.full((n,), cfg.mask_token_id, dtype=mx.int32)])
        x = self.block_input(ids)[None]
        q_pos = mx.arange(length, length + n + 1)
        masks = {}       # layers with the same window, causality and context share one mask
        for i, (layer, (ck, cv)) in enumerate(zip(self.layers, cache.layers)):
            key = (ck.shape[2], layer.self_attn.window, self.causal(i))
            if key not in masks:
                k_pos = mx.arange(length - ck.shape[2], length + n + 1)
                masks[key] = window_mask(q_pos, k_pos, key[1], key[2])
            x = layer(x, length, ck, cv, masks[key])
        return self.norm(x[0, 1:])


class DSparkDrafter(BlockDrafter):
    """NVIDIA's DSpark: the block backbone, the target's lm_head, then the Markov head."""

    label = "DSpark"

    def __init__(self, cfg: DrafterConfig, w: dict, target, dtype, share_embedding: bool,
                 nvfp4: str | None = None):
        super().__init__(cfg, w, target, dtype, share_embedding, nvfp4)
        self.markov_head = MarkovHead(Weights(w, dtype, nvfp4))
        self._draws = CompiledPerKey(self._compiled_draws, DRAW_SETTINGS)

    def block_logits(self, bonus, n: int, cache: "DrafterCache | None" = None) -> mx.array:
        """``U [n, V]``: the target's lm_head over rows 1..n of the block (before Markov)."""
        return self._target.lm_head(self.block_hidden(bonus, n, cache)).astype(mx.float32)

    def draft(self, bonus, n: int, draw: Draw, cache: "DrafterCache"):
        """The block's ``U``, then the Markov chain: ``z_j = U_j + W2 W1[prev]``, each row
        corrected by the token drawn before it. Compiled per sampling setting (its shapes are
        fixed for an n), except under a grammar (which reads each draft back), processors or a
        user's sampler (Python callables)."""
        u = self.block_logits(bonus, n, cache)
        if not draw.compiled:
            return self._markov(u, bonus, draw)
        return self._draws(draw.settings, u, bonus, draw.noise, *draw.settings)

    def _markov(self, u, bonus, draw: Draw):
        return draw.chain(lambda j, prev: u[j:j + 1] + self.markov_head(prev), bonus,
                          u.shape[0])

    def _compiled_draws(self, u, bonus, noise, *settings):
        return self._markov(u, bonus, Draw.of(*settings, noise=noise))


class DrafterCache:
    """The drafter's context: per layer the keys and values of the committed tokens a future
    query can still see, and ``length``, the context tokens seen (skipped ones included).

    Made by :meth:`DSparkDrafter.make_cache` and owned by a session, as the target's cache is.
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


def load(source: str, target, *, dtype=None, verify: str = "auto", verbose: bool = False,
         nvfp4: str | None = None) -> DSparkDrafter:
    """Load the converted DSpark drafter in the directory ``source`` for ``target`` and pass it
    through the weight-load gate.

    ``dtype`` is the compute dtype or its name (None: the target's ``dtype`` attribute if it has
    one, else float32). ``nvfp4`` picks the NVFP4 compute path as for the target
    (quant.nvfp4_policy when None). The drafter borrows the target's lm_head, and its embedding
    when the drafter's own copy is bit-identical to it. ``verify``: how much of the files is
    checked against the conversion receipt first (checkpoint/integrity.py); a drafter without a
    receipt needs ``"none"``."""
    return load_block(DSparkDrafter, fits, "NVIDIA's DSpark layout", source, target,
                      dtype=dtype, verify=verify, verbose=verbose, nvfp4=nvfp4)


def fits(raw: dict, where: str, target) -> DrafterConfig:
    """The DSpark config ``raw`` parsed and fitted to ``target`` (its config an object or a
    dict): what a load refuses before any weight is read."""
    return fitted(parse_config, raw, where, target)


def fitted(parse_config, raw: dict, where: str, target):
    """A block drafter's config parsed by ``parse_config`` and fitted to ``target``."""
    cfg = parse_config(raw, where)
    check_fits(cfg, target, where)
    return cfg


def load_block(kind, fits, layout: str, source: str, target, *, dtype, verify,
               verbose, nvfp4):
    """A converted block drafter of class ``kind`` (DSpark, DFlash): its config parsed and
    fitted to ``target`` by ``fits(raw, where, target)``, its tensors checked against the
    config (``layout``: what a message calls the tensor layout), built, passed through the
    gate."""
    source, dtype = str(source), draft_dtype(dtype, target)
    raw, cfg, weights, origin = read_converted(source, verify,
                                               lambda raw, where: fits(raw, where, target))
    if kind.optional_embedding and "embed_tokens.weight" in weights:
        cfg = replace(cfg, has_embed_tokens=True)
    check_tensors(cfg, weights, origin, source, raw["quantization"].get("modules") or {},
                  layout)
    drafter = kind(cfg, weights, target, dtype, shares_embedding(weights, target), nvfp4)
    del weights
    return through_gate(drafter, source, verbose)
