"""NVIDIA's DSpark drafter (``Qwen3DSparkModel``) over the converted checkpoint layout.

One drafting round (DESIGN §6), with ``P`` = number of context tokens:

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

import glob
import hashlib
import json
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .kernels.attention import sink_attention, window_mask
from .quant import GROUP_SIZE, ScaledLinear, make_linear, module_format
from .sampling import gumbel_max

LAYOUT = "mlx-dspark/1"


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used (bad file, unsupported variant, wrong target)."""


# --------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    windows: tuple  # per layer: sliding window in keys (including the query's own), or None
    attention_sinks: bool
    block_size: int  # bonus + up to block_size - 1 drafted tokens
    mask_token_id: int
    target_layer_ids: tuple  # 0-based target layers whose outputs are tapped
    target_hidden_size: int  # width of each tap (the target's hidden size)
    markov_rank: int
    has_embed_tokens: bool


def _pick(cfg: dict, names, where: str, default=None):
    """The value of the first of ``names`` found in ``cfg`` or its ``dflash_config`` (NVIDIA
    writes some fields in both places); every copy present must agree."""
    found = {}
    for scope, d in (("", cfg), ("dflash_config.", cfg.get("dflash_config") or {})):
        for n in names:
            if n in d and d[n] is not None:
                found[scope + n] = d[n]
    values = list(found.values())
    if any(v != values[0] for v in values[1:]):
        raise DrafterError(f"{where}: contradictory values {found}")
    return values[0] if values else default


def _unsupported(where: str, what: str):
    raise DrafterError(f"{where}: unsupported drafter variant: {what}")


def parse_config(cfg: dict, where: str = "config.json") -> DrafterConfig:
    """Parse NVIDIA's DSpark ``config.json``; refuse variants this runtime does not implement."""
    archs = cfg.get("architectures") or []
    if "Qwen3DSparkModel" not in archs:
        _unsupported(where, f"architectures {archs} (only NVIDIA's Qwen3DSparkModel layout)")
    if cfg.get("model_type", "qwen3") != "qwen3":
        _unsupported(where, f"model_type {cfg['model_type']!r} (expected 'qwen3')")
    if cfg.get("hidden_act", "silu") != "silu":
        _unsupported(where, f"hidden_act {cfg['hidden_act']!r} (SwiGLU with silu only)")

    # Block shape: NVIDIA's is a causal [bonus, mask x N] block; the DeepSeek reference layout
    # (anchor-first, bidirectional, confidence head, own lm_head) is not implemented.
    if _pick(cfg, ["causal"], where) is not True:
        _unsupported(where, "dflash_config.causal is not true (bidirectional block attention)")
    if _pick(cfg, ["dspark_bonus_anchor"], where) is not True:
        _unsupported(where, "dspark_bonus_anchor is not true (anchor-first block)")
    if _pick(cfg, ["sample_from_anchor"], where, False):
        _unsupported(where, "sample_from_anchor=true")
    if cfg.get("has_lm_head", False):
        _unsupported(where, "has_lm_head=true (own lm_head; DSpark uses the target's)")
    if _pick(cfg, ["enable_confidence_head", "confidence_head", "dspark_confidence_head"],
             where, False):
        _unsupported(where, "confidence head")
    vocab = int(cfg["vocab_size"])
    if cfg.get("draft_vocab_size") not in (None, vocab):
        _unsupported(where, f"draft_vocab_size {cfg['draft_vocab_size']} != vocab_size "
                            f"{vocab} (reduced draft vocabulary with d2t)")
    fixup = _pick(cfg, ["dspark_fixup_head_type"], where, "markov")
    if fixup != "markov":
        _unsupported(where, f"dspark_fixup_head_type {fixup!r} (only 'markov')")
    markov_type = _pick(cfg, ["markov_head_type"], where, "vanilla")
    if markov_type != "vanilla":
        _unsupported(where, f"markov_head_type {markov_type!r} (only 'vanilla')")
    rank = _pick(cfg, ["markov_rank", "dspark_markov_rank"], where)
    if not rank:
        raise DrafterError(f"{where}: no markov_rank")

    # Attention: RoPE, sliding window, sinks.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _unsupported(where, f"rope type {rope_type!r} (plain RoPE only)")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise DrafterError(f"{where}: no rope_theta")
    n_layers = int(cfg["num_hidden_layers"])
    window = _pick(cfg, ["sliding_window", "swa_window_size"], where)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        use_swa = _pick(cfg, ["use_swa", "use_sliding_window"], where, False)
        layer_types = ["sliding_attention" if use_swa else "full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise DrafterError(f"{where}: {len(layer_types)} layer_types for {n_layers} layers")
    windows = []
    for t in layer_types:
        if t == "sliding_attention":
            if not window or int(window) < 1:
                raise DrafterError(f"{where}: sliding_attention layer without sliding_window")
            windows.append(int(window))
        elif t == "full_attention":
            windows.append(None)
        else:
            _unsupported(where, f"layer type {t!r}")
    sinks = bool(_pick(cfg, ["attention_sink_bias"], where, False))

    # Taps: vLLM's eagle_aux_hidden_state_layer_ids count layers done (= ours + 1).
    ids = _pick(cfg, ["target_layer_ids"], where)
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and eagle is not None:
        ids = [i - 1 for i in eagle]
    if not ids:
        raise DrafterError(f"{where}: no target_layer_ids (or eagle_aux_hidden_state_layer_ids)")
    if eagle is not None and [i + 1 for i in ids] != list(eagle):
        raise DrafterError(f"{where}: target_layer_ids {ids} and eagle_aux_hidden_state_layer_ids"
                           f" {eagle} disagree (the eagle ids must be target_layer_ids + 1)")

    block_size = int(cfg.get("block_size", 0))
    if block_size < 2:
        raise DrafterError(f"{where}: block_size {block_size} (need >= 2)")
    mask_id = _pick(cfg, ["mask_token_id"], where)
    if mask_id is None or not 0 <= int(mask_id) < vocab:
        raise DrafterError(f"{where}: mask_token_id {mask_id} not in [0, {vocab})")
    heads = int(cfg["num_attention_heads"])
    return DrafterConfig(
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=vocab,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        windows=tuple(windows),
        attention_sinks=sinks,
        block_size=block_size,
        mask_token_id=int(mask_id),
        target_layer_ids=tuple(int(i) for i in ids),
        target_hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        markov_rank=int(rank),
        has_embed_tokens=bool(cfg.get("has_embed_tokens", True)),
    )


def _target_dims(target):
    c = target.config
    get = (lambda k: c.get(k)) if isinstance(c, dict) else (lambda k: getattr(c, k, None))
    return get("hidden_size"), get("vocab_size"), get("num_hidden_layers")


def check_fits(cfg: DrafterConfig, target, where: str):
    """Refuse a drafter that was not built for this target."""
    hidden, vocab, layers = _target_dims(target)
    for name, size in (("hidden_size", cfg.hidden_size), ("target_hidden_size",
                                                          cfg.target_hidden_size)):
        if size != hidden:
            raise DrafterError(f"{where}: drafter {name} {size} != target hidden_size {hidden} "
                               "(wrong drafter for this target)")
    if cfg.vocab_size != vocab:
        raise DrafterError(f"{where}: drafter vocab_size {cfg.vocab_size} != target "
                           f"vocab_size {vocab} (wrong drafter for this target)")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise DrafterError(f"{where}: target_layer_ids {list(cfg.target_layer_ids)} out of range"
                           f" for a {layers}-layer target (wrong drafter for this target)")


# --------------------------------------------------------------------------------------------
# Reading the checkpoint


def _checkpoint_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
    if not files:
        raise DrafterError(f"{path}: no model*.safetensors files")
    return files


def check_receipt(path: str):
    """When the converter's receipt is present, the model files must still hash to what it
    recorded: a flipped byte in a tensor is otherwise invisible (the gate compares the loaded
    model with the file, not the file with the conversion)."""
    receipt = os.path.join(path, "MERERUN_CONVERSION.json")
    if not os.path.exists(receipt):
        return
    try:
        with open(receipt) as fh:
            outputs = json.load(fh)["outputs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DrafterError(f"{receipt}: unreadable conversion receipt ({e})") from None
    for f in _checkpoint_files(path):
        want = outputs.get(os.path.basename(f), {}).get("sha256")
        if want is None:
            raise DrafterError(f"{f}: not listed in the conversion receipt {receipt}")
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        if h.hexdigest() != want:
            raise DrafterError(f"{f}: sha256 {h.hexdigest()} differs from the conversion receipt "
                               f"({want}): the file changed after conversion")


def read_weights(path: str) -> tuple[dict, dict]:
    """All tensors of the checkpoint, and which file each came from."""
    weights, origin = {}, {}
    for f in _checkpoint_files(path):
        try:
            shard = mx.load(f)
        except Exception as e:  # MLX reports truncated/corrupt files with various types
            raise DrafterError(f"{f}: unreadable safetensors file ({e})") from None
        for k, v in shard.items():
            weights[k] = v
            origin[k] = f
    return weights, origin


def _expected_linears(cfg: DrafterConfig) -> dict:
    """prefix -> (out, in) for every linear module of the drafter."""
    h, hd = cfg.hidden_size, cfg.head_dim
    lin = {"fc": (h, h * len(cfg.target_layer_ids)),
           "markov_head.markov_w2": (cfg.vocab_size, cfg.markov_rank)}
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        lin.update({f"{a}.q_proj": (cfg.num_heads * hd, h), f"{a}.k_proj": (cfg.num_kv_heads * hd, h),
                    f"{a}.v_proj": (cfg.num_kv_heads * hd, h), f"{a}.o_proj": (h, cfg.num_heads * hd),
                    f"{m}.gate_proj": (cfg.intermediate_size, h), f"{m}.up_proj": (cfg.intermediate_size, h),
                    f"{m}.down_proj": (h, cfg.intermediate_size)})
    return lin


def _expected_plain(cfg: DrafterConfig) -> dict:
    """name -> shape for every non-linear tensor."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"hidden_norm.weight": (h,), "norm.weight": (h,),
              "markov_head.markov_w1.weight": (cfg.vocab_size, cfg.markov_rank)}
    if cfg.has_embed_tokens:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
        if cfg.attention_sinks:
            shapes[f"{p}.self_attn.attention_sink_bias"] = (cfg.num_heads,)
    return shapes


_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def check_tensors(cfg: DrafterConfig, weights: dict, origin: dict, path: str, declared: dict):
    """Every expected tensor present with the right dtype and shape, nothing unexpected."""
    def where(name):
        return origin.get(name, path)

    expected = set()
    for name, shape in _expected_plain(cfg).items():
        expected.add(name)
        if name not in weights:
            raise DrafterError(f"{path}: missing tensor {name}")
        w = weights[name]
        if tuple(w.shape) != shape or w.dtype not in _FLOATS:
            raise DrafterError(f"{where(name)}: tensor {name} is {w.dtype} {tuple(w.shape)}, "
                               f"expected a float tensor of shape {shape}")
    for prefix, (out, inp) in _expected_linears(cfg).items():
        # The converter's declaration wins (so a lost scale tensor reads as missing, not as
        # a dense layer); undeclared modules go by the tensors present.
        fmt = declared.get(prefix, module_format(weights, prefix))
        fmt = {"bf16": "dense", "float16": "dense", "float32": "dense"}.get(fmt, fmt)
        if fmt not in ("nvfp4", "fp8", "dense"):
            raise DrafterError(f"{path}: config.json declares {prefix} as {fmt!r} "
                               "(expected nvfp4, fp8, bf16, float16 or float32)")
        if fmt == "nvfp4":
            want = {".weight": (mx.uint32, (out, inp // 8)),
                    ".scales": (mx.uint8, (out, inp // GROUP_SIZE)),
                    ".weight_scale_2": (mx.float32, ())}
        elif fmt == "fp8":
            want = {".weight": (mx.uint8, (out, inp)), ".weight_scale": (mx.float32, ())}
        else:
            want = {".weight": (None, (out, inp))}
        if fmt != "dense" and inp % GROUP_SIZE:
            raise DrafterError(f"{path}: {prefix} has {inp} inputs, not a multiple of {GROUP_SIZE}")
        for suffix, (dtype, shape) in want.items():
            name = prefix + suffix
            expected.add(name)
            if name not in weights:
                raise DrafterError(f"{path}: missing tensor {name} ({fmt} {prefix})")
            w = weights[name]
            ok_dtype = w.dtype in _FLOATS if dtype is None else w.dtype == dtype
            if tuple(w.shape) != shape or not ok_dtype:
                raise DrafterError(f"{where(name)}: tensor {name} is {w.dtype} {tuple(w.shape)}, "
                                   f"expected {dtype or 'float'} {shape}")
        if f"{prefix}.bias" in weights:
            expected.add(f"{prefix}.bias")
    extra = sorted(set(weights) - expected)
    if extra:
        raise DrafterError(f"{path}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}"
                           " (not part of NVIDIA's DSpark layout as configured)")


# --------------------------------------------------------------------------------------------
# Model


class Norm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, w: dict, p: str, dtype, nvfp4, window):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            make_linear(w, f"{p}.{n}", dtype, nvfp4) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.q_norm = Norm(w[f"{p}.q_norm.weight"].astype(dtype), cfg.rms_norm_eps)
        self.k_norm = Norm(w[f"{p}.k_norm.weight"].astype(dtype), cfg.rms_norm_eps)
        if cfg.attention_sinks:
            self.attention_sink_bias = w[f"{p}.attention_sink_bias"].astype(dtype)
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
    def __init__(self, w, p, dtype, nvfp4):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            make_linear(w, f"{p}.{n}", dtype, nvfp4) for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg, w, i, dtype, nvfp4):
        super().__init__()
        p = f"layers.{i}"
        self.input_layernorm = Norm(w[f"{p}.input_layernorm.weight"].astype(dtype), cfg.rms_norm_eps)
        self.post_attention_layernorm = Norm(w[f"{p}.post_attention_layernorm.weight"].astype(dtype),
                                             cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", dtype, nvfp4, cfg.windows[i])
        self.mlp = MLP(w, f"{p}.mlp", dtype, nvfp4)

    def __call__(self, x, pos0, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), pos0, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """``bias(prev) = W2 · W1[prev]``; computed in fp32 whatever the model dtype, because each
    drawn token feeds the next step."""

    def __init__(self, w, nvfp4):
        super().__init__()
        self.markov_w1 = nn.Module()
        self.markov_w1.weight = w["markov_head.markov_w1.weight"]  # kept in its stored dtype
        self.markov_w2 = make_linear(w, "markov_head.markov_w2", mx.float32, nvfp4)

    def __call__(self, prev):
        return self.markov_w2(self.markov_w1.weight[prev].astype(mx.float32))


class Drafter(nn.Module):
    """Parameter names mirror the checkpoint's tensor names (the weight-load gate relies on it)."""

    def __init__(self, cfg: DrafterConfig, w: dict, target, dtype, share_embedding: bool,
                 nvfp4: str | None = None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.fc = make_linear(w, "fc", dtype, nvfp4)
        self.hidden_norm = Norm(w["hidden_norm.weight"].astype(dtype), cfg.rms_norm_eps)
        self.layers = [Layer(cfg, w, i, dtype, nvfp4) for i in range(cfg.num_layers)]
        self.norm = Norm(w["norm.weight"].astype(dtype), cfg.rms_norm_eps)
        self.markov_head = MarkovHead(w, nvfp4)
        if not share_embedding:
            self.embed_tokens = nn.Module()
            self.embed_tokens.weight = w["embed_tokens.weight"]  # stored dtype; rows cast on use
        # Borrowed lm_head (and embedding). Set around nn.Module's attribute hook so the
        # target is neither a parameter nor a child module of the drafter.
        object.__setattr__(self, "_target", target)
        self.gate_report = None
        self.reset()

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    def _embed(self, ids):
        if "embed_tokens" in self:
            return self.embed_tokens.weight[ids].astype(self.dtype)
        return self._target.embed(ids).astype(self.dtype)

    def reset(self):
        """Forget all context."""
        self.length = 0
        empty = mx.zeros((1, self.config.num_kv_heads, 0, self.config.head_dim), self.dtype)
        self._cache = [(empty, empty) for _ in self.layers]  # "_": not a parameter

    @property
    def state(self) -> list[mx.array]:
        """The context cache's arrays (``add_context`` leaves them lazy)."""
        return [x for kv in self._cache for x in kv]

    @property
    def cache_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._cache)

    def add_context(self, taps: mx.array, start_pos: int):
        """Commit taps ``[T, n_taps*hidden]`` of the tokens at positions start_pos.. ."""
        if start_pos != self.length:
            raise ValueError(f"add_context at position {start_pos}, but the drafter holds "
                             f"{self.length} context tokens (contexts must be contiguous)")
        want = self.config.hidden_size * len(self.config.target_layer_ids)
        if taps.ndim != 2 or taps.shape[1] != want:
            raise ValueError(f"taps must be [T, {want}], got {tuple(taps.shape)}")
        c = self.hidden_norm(self.fc(taps.astype(self.dtype)))[None]
        cache = []
        for layer, (ck, cv) in zip(self.layers, self._cache):
            k, v = layer.self_attn.context_kv(c, start_pos)
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
            window = layer.self_attn.window
            if window is not None:
                # The earliest future query (position `length`) sees keys > length - window.
                start = max(0, k.shape[2] - (window - 1))
                k, v = k[:, :, start:], v[:, :, start:]
            cache.append((k, v))
        self._cache = cache
        self.length = start_pos + taps.shape[0]

    def block_logits(self, bonus, n: int) -> mx.array:
        """``U [n, V]``: the target's lm_head over rows 1..n of the block (before Markov)."""
        cfg = self.config
        ids = mx.concatenate([mx.array(bonus, dtype=mx.int32).reshape(1),
                              mx.full((n,), cfg.mask_token_id, dtype=mx.int32)])
        x = self._embed(ids)[None]
        q_pos = mx.arange(self.length, self.length + n + 1)
        for layer, (ck, cv) in zip(self.layers, self._cache):
            k_pos = mx.arange(self.length - ck.shape[2], self.length + n + 1)
            mask = window_mask(q_pos, k_pos, layer.self_attn.window)
            x = layer(x, self.length, ck, cv, mask)
        h = self.norm(x[0, 1:])
        return self._target.lm_head(h).astype(mx.float32)

    def propose(self, bonus, n: int, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, noise: mx.array | None = None):
        """Draft ``n`` tokens after ``bonus`` (which sits at position ``length``).

        ``d_j = argmax(log warp(z_j) + noise[j-1])`` (``sampling.gumbel_max``): with Gumbel
        noise ``[n, V]`` a sample from the warped draft distribution, without (greedy) the
        argmax. Returns lazy ``tokens [n]`` and ``logits [n, V]``: the Markov-corrected logits
        each token was drawn from (warp them with ``sampling.warp`` for the distribution)."""
        if not 1 <= n < self.config.block_size:
            raise ValueError(f"n={n}: this drafter drafts 1..{self.config.block_size - 1} "
                             f"tokens (block_size {self.config.block_size})")
        u = self.block_logits(bonus, n)
        prev = mx.array(bonus, dtype=mx.int32).reshape(1)
        tokens, logits = [], []
        for j in range(n):
            z = u[j:j + 1] + self.markov_head(prev)
            g = None if noise is None else noise[j:j + 1]
            prev = gumbel_max(z, temperature, top_p, top_k, g).astype(mx.int32)
            tokens.append(prev)
            logits.append(z)
        return mx.concatenate(tokens), mx.concatenate(logits)


# --------------------------------------------------------------------------------------------
# Weight-load gate


_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
              "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
              "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F8_E4M3": np.uint8}


def read_raw_safetensors(f: str) -> dict:
    """name -> (safetensors dtype string, numpy array of the stored bits), parsed from the
    file's own header (independent of MLX's loader, so the gate checks one with the other)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    data = np.memmap(f, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], data[b:e].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"]))
    return out


def _e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 E4M3 bytes (bias 7, subnormals, 0x7F/0xFF = NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7) / 8.0
    v = np.where(e == 0, m * 2.0 ** -6, (1 + m) * 2.0 ** (e - 7.0))
    v[(e == 15) & (b & 7 == 7)] = np.nan
    return np.where(b & 0x80, -v, v).astype(np.float32)


_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _decode(st_dtype: str, arr: np.ndarray) -> np.ndarray | None:
    """A stored float tensor as float32 values (exact), or None for non-float storage."""
    if st_dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if st_dtype in ("F16", "F32"):
        return arr.astype(np.float32)
    return None


def _decode_nvfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 code x E4M3 block scale (no tensor scale) as float32; exact. Codes: 8 per uint32,
    element i in bits 4i..4i+3, i.e. low nibble first in little-endian bytes."""
    b = codes.view(np.uint8)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(codes.shape[0], -1)
    return _E2M1[nib] * np.repeat(_e4m3_values()[scales], GROUP_SIZE, axis=-1)


def _same(want: np.ndarray, got: mx.array) -> bool:
    """``got`` equals the file's values: bit for bit for integer storage; for floats, the exact
    file values converted to ``got``'s dtype (a no-op unless the model computes in a narrower
    dtype than the file stores)."""
    if tuple(want.shape) != tuple(got.shape):
        return False
    if want.dtype.kind in "ui":
        return np.array_equal(np.array(got), want)
    want = mx.array(want).astype(got.dtype)
    return bool(mx.array_equal(want, got, equal_nan=True).item())


def weight_gate(drafter: Drafter, path: str) -> str:
    """Compare every tensor of the checkpoint with what ``drafter`` holds; raise on any mismatch
    or when nothing was comparable. Returns the report ``"k/k tensors match"``."""
    stored = {}
    for f in _checkpoint_files(path):
        for name, (st_dtype, arr) in read_raw_safetensors(f).items():
            stored[name] = (f, st_dtype, arr)
    params = dict(tree_flatten(drafter.parameters()))
    checks = []  # (checkpoint tensors, their values, model parameter)
    used = set()  # model parameters checked by a decoding rule
    absent = []  # model parameters with no counterpart in the checkpoint
    for prefix, m in drafter.named_modules():
        if not isinstance(m, ScaledLinear):
            continue
        used |= {f"{prefix}.weight", f"{prefix}.scale"}
        # NVFP4 decoded at load (weight = e2m1 x e4m3, scale = ws2), or FP8 decoded at load
        nvfp4 = f"{prefix}.scales" in stored
        names = [f"{prefix}.weight", f"{prefix}.scales"] if nvfp4 else [f"{prefix}.weight"]
        scale = f"{prefix}.weight_scale_2" if nvfp4 else f"{prefix}.weight_scale"
        if any(n not in stored for n in (*names, scale)):
            absent.append(prefix)
            continue
        codes = stored[names[0]][2]
        want = _decode_nvfp4(codes, stored[names[1]][2]) if nvfp4 else _e4m3_values()[codes]
        checks.append((names, want, m.weight))
        checks.append(([scale], _decode(*stored[scale][1:]), m.scale))
    for name, p in params.items():
        if name in used:
            continue
        if name not in stored:
            absent.append(name)
            continue
        f, st_dtype, arr = stored[name]
        checks.append(([name], _decode(st_dtype, arr) if p.dtype in _FLOATS else arr, p))
    if "embed_tokens.weight" in stored and "embed_tokens.weight" not in params:
        # Shared with the target: what the target's embedding returns must be the file's.
        f, st_dtype, arr = stored["embed_tokens.weight"]
        checks.append((["embed_tokens.weight"], _decode(st_dtype, arr), _shared_embedding(drafter)))

    matched, bad, seen = 0, [], set()
    for names, want, got in checks:
        seen.update(names)
        if want is not None and _same(want, got):
            matched += len(names)
        else:
            bad.append(f"{'+'.join(names)} ({stored[names[0]][0]}): loaded values differ from the file")
    bad += [f"{n} ({stored[n][0]}): not loaded into the drafter" for n in sorted(set(stored) - seen)]
    bad += [f"{n}: in the drafter but not in the checkpoint" for n in absent]
    if matched == 0:
        raise DrafterError(f"{path}: weight-load gate refused the drafter: no tensor could be "
                           f"compared with the checkpoint ({len(bad)} problem(s))")
    if bad:
        raise DrafterError(f"{path}: weight-load gate refused the drafter: {len(bad)} problem(s): "
                           + "; ".join(bad[:5]))
    return f"{matched}/{len(stored)} tensors match"


def _shared_embedding(drafter: Drafter) -> mx.array:
    """The target's embedding table, read through ``target.embed`` in chunks."""
    v = drafter.config.vocab_size
    rows = [drafter._target.embed(mx.arange(s, min(s + 8192, v))) for s in range(0, v, 8192)]
    return mx.concatenate(rows)


def _embedding_identical(own: mx.array, target) -> bool:
    v = own.shape[0]
    for s in range(0, v, 8192):
        ids = mx.arange(s, min(s + 8192, v))
        t = target.embed(ids)
        if not mx.array_equal(t.astype(mx.float32), own[ids].astype(mx.float32)).item():
            return False
    return True


# --------------------------------------------------------------------------------------------
# Loading


def load_drafter(path: str, target, dtype=None, nvfp4: str | None = None,
                 verbose: bool = False) -> Drafter:
    """Load a converted DSpark drafter for ``target`` and pass it through the weight-load gate.

    ``dtype`` is the compute dtype (None: the target's ``dtype`` attribute if it has one, else
    float32). ``nvfp4`` picks the NVFP4 compute path as for the target (quant.nvfp4_policy
    when None). The drafter borrows the target's lm_head, and its embedding when the drafter's
    own copy is bit-identical to it."""
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

    check_receipt(path)
    weights, origin = read_weights(path)
    check_tensors(cfg, weights, origin, path, quant.get("modules") or {})
    share = (not cfg.has_embed_tokens
             or _embedding_identical(weights["embed_tokens.weight"], target))
    drafter = Drafter(cfg, weights, target, dtype, share, nvfp4)
    del weights
    mx.eval(drafter.parameters())
    drafter.gate_report = weight_gate(drafter, path)
    if verbose:
        print(f"drafter {path}: {drafter.gate_report}")
    return drafter
