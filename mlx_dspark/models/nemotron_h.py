"""Nemotron-H, the hybrid target: Mamba-2 (``M``), MoE (``E``), attention (``*``) and dense
MLP (``-``) blocks, each ``x + mixer(RMSNorm(x))``, then ``norm_f`` and an untied ``lm_head``.

Beyond a plain forward it does what speculative decoding needs (docs/design.md §5):

* ``step`` advances a cache and can return *taps*: the residual stream after chosen layers,
  before ``norm_f``, concatenated in order ``[T, n*hidden]``.
* ``verify`` is a step that remembers, per Mamba layer, the state before the block and each
  position's recurrence inputs; ``commit(cache, n)`` then keeps the first ``n`` positions:
  attention KV is trimmed, Mamba states are restored and the recurrence alone is replayed over
  the accepted positions (no weights read, no extra model pass; nothing at all when every
  position is kept).

Numerics (where we knowingly differ from the references):

* The Mamba mixer computes in float32 from the ``in_proj`` output to the gated norm (conv,
  dt, the SSM and its fp32 states, the gated RMSNorm), then casts to the compute dtype for
  ``out_proj``. transformers runs the conv in the weight dtype; in fp32 both agree.
* dt is ``clip(softplus(dt + dt_bias), *time_step_limit)`` on every path, with the config's
  ``time_step_limit`` (default ``(0, inf)``: no clamp), as mlx-lm and NVIDIA's kernels do.
  transformers instead clamps at ``time_step_min`` (1e-3) in its chunked (prefill) path only
  and not in its single-token path, so its prefill and decode disagree whenever
  ``softplus(dt + dt_bias) < 1e-3``; one rule on every path is what keeps our incremental
  decoding equal to a full forward and rollback exact.
* Blocks of at most ``SERIAL_MAX`` positions (decode steps, every verify, every replay) run
  the SSM recurrence position by position through one function (kernels/mamba.py), so a
  replayed state is bit-identical to a serial run; longer inputs (prefill) use the chunked
  scan, equal to the serial one up to float32 rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.formats import convert_first, detect_dir, read_target_config, tensor_shapes
from ..checkpoint.recorded import check_files
from ..checkpoint.integrity import CheckpointError
from ..converter.layout import decode_float, latent_problem, layer_pattern
from ..converter.shapes import check_quantization, check_tensors, check_values
from ..device import on_gpu
from ..kernels import mamba as K
from ..kernels.norm import gated_rms_norm, rms_norm
from .cache import KVCache, KVRows, MambaCache, RowsCache, TargetCache
from .mlx_lm_layout import mlx_lm_weights
from .quant import Weights, make_linear
from .weights import read_weights

SERIAL_MAX = 8
"""Longest block whose SSM recurrence runs position by position (covers N+1 <= 8 verify)."""

PREFILL_STEP = 2048
"""Longest piece a cached step feeds through the model at once (longer prompts go in pieces):
bounds the attention scores, which MLX's CPU attention materializes (heads x T x L). A
multiple of Nemotron's Mamba chunk size (128), so the scan's chunking is unchanged."""


@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    hybrid_override_pattern: str
    layer_norm_epsilon: float = 1e-5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    time_step_limit: tuple = (0.0, float("inf"))
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "TargetConfig":
        d = dict(d)
        pattern = d.pop("hybrid_override_pattern", None)
        kinds = d.pop("layers_block_type", None) or d.pop("layer_types", None)
        if pattern is None and kinds is not None:
            try:
                pattern = layer_pattern(kinds)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
        if pattern is None:
            raise ValueError(f"{source}: needs hybrid_override_pattern or layers_block_type")
        if not isinstance(pattern, str) or set(pattern) - set("ME*-"):
            raise ValueError(f"{source}: hybrid_override_pattern {pattern!r} has block kinds "
                             "other than M, E, * and -")
        if "n_routed_experts" not in d and "num_local_experts" in d:
            d["n_routed_experts"] = d["num_local_experts"]
        names = {f.name for f in fields(cls)} - {"extra", "hybrid_override_pattern"}
        known = {k: d[k] for k in names if k in d and d[k] is not None}
        missing = [k for k in ("vocab_size", "hidden_size") if k not in known]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}")
        cfg = cls(hybrid_override_pattern=pattern, extra=d, **known)
        check_values(cfg.values(), pattern, source)
        cfg.time_step_limit = tuple(decode_float(v) for v in cfg.time_step_limit)
        return cfg

    def values(self) -> dict:
        """The config as converter/shapes.py checks it: ``config.json``'s fields with the
        defaults filled in."""
        return {**self.extra, **{f.name: getattr(self, f.name) for f in fields(self)
                                 if f.name != "extra"}}


# ------------------------------------------------------------------------------- blocks


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: TargetConfig, w: Weights, p: str):
        super().__init__()
        self.h, self.hp = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.g, self.n = cfg.n_groups, cfg.ssm_state_size
        self.d_inner = self.h * self.hp
        self.conv_dim = self.d_inner + 2 * self.g * self.n
        self.eps = cfg.layer_norm_epsilon
        self.limit = cfg.time_step_limit
        self.chunk = cfg.chunk_size
        self.in_proj = w.linear(f"{p}.in_proj")
        self.out_proj = w.linear(f"{p}.out_proj")
        cw = w[f"{p}.conv1d.weight"]
        # HF (C, 1, K); mlx-lm (C, K, 1); converted keeps the source (C, 1, K).
        self.conv_weight = cw.reshape(cw.shape[0], -1).astype(mx.float32)
        cb = w.get(f"{p}.conv1d.bias")
        self.conv_bias = None if cb is None else cb.astype(mx.float32)
        self.dt_bias = w[f"{p}.dt_bias"].astype(mx.float32)
        self.A = -mx.exp(w[f"{p}.A_log"].astype(mx.float32))
        self.D = w[f"{p}.D"].astype(mx.float32)
        self.norm_weight = w.cast(f"{p}.norm.weight")

    def __call__(self, h, cache: MambaCache | None, record: bool):
        b, t, _ = h.shape
        zxbcdt = self.in_proj(h)
        gate, xbc, dt = mx.split(zxbcdt, [self.d_inner, self.d_inner + self.conv_dim], axis=-1)
        xbc = xbc.astype(mx.float32)
        k1 = self.conv_weight.shape[1] - 1
        conv0 = cache.conv if cache is not None and cache.conv is not None else \
            mx.zeros((b, k1, self.conv_dim), mx.float32)
        padded = mx.concatenate([conv0, xbc], axis=1)
        conv = nn.silu(K.causal_conv(padded, self.conv_weight, self.conv_bias))
        x, B, C = mx.split(conv, [self.d_inner, self.d_inner + self.g * self.n], axis=-1)
        x = x.reshape(b, t, self.h, self.hp)
        B = B.reshape(b, t, self.g, self.n)
        C = C.reshape(b, t, self.g, self.n)
        dt = K.discretize_dt(dt, self.dt_bias, self.limit)
        ssm0 = cache.ssm if cache is not None else None
        if t <= SERIAL_MAX or record:
            if ssm0 is None:
                ssm0 = mx.zeros((b, self.h, self.hp, self.n), mx.float32)
            y, ssm = K.ssm_serial(ssm0, x, dt, self.A, B, C, self.D)
        else:
            y, ssm = K.ssm_chunked(ssm0, x, dt, self.A, B, C, self.D, self.chunk)
        if cache is not None:
            if record:
                cache.record = (conv0, ssm0, xbc, x, dt, B, C)
            # after a long step, copy the window out: a view would keep the whole step's
            # input alive (T x conv_dim floats per layer) in the cache and its snapshots
            cache.conv = (mx.contiguous(padded[:, -k1:]) if t > SERIAL_MAX else
                          padded[:, -k1:]) if k1 else conv0
            cache.ssm = ssm
        y = gated_rms_norm(y.reshape(b, t, self.d_inner), gate, self.norm_weight, self.g,
                           self.eps)
        return self.out_proj(y)


class Attention(nn.Module):
    """Causal GQA attention without positional encoding."""

    def __init__(self, cfg: TargetConfig, w: Weights, p: str):
        super().__init__()
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.hd ** -0.5
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, w.linear(f"{p}.{name}"))

    def __call__(self, h, cache: KVCache | None):
        b, t, _ = h.shape
        q = self.q_proj(h).reshape(b, t, self.nh, self.hd).transpose(0, 2, 1, 3)
        k = self.k_proj(h).reshape(b, t, self.nkv, self.hd).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(b, t, self.nkv, self.hd).transpose(0, 2, 1, 3)
        if isinstance(cache, KVRows):         # rows decoded together: each over its own keys
            o = mx.concatenate([self.attend(q[i:i + 1], *c.update(k[i:i + 1], v[i:i + 1]))
                                for i, c in enumerate(cache.rows)])
        else:
            o = self.attend(q, *(cache.update(k, v) if cache is not None else (k, v)))
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def attend(self, q, k, v):
        # "causal" aligns the queries with the last keys, so it also serves cached blocks.
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale,
                                                    mask="causal" if q.shape[2] > 1 else None)


class MLP(nn.Module):
    """``down(relu(up x)^2)``: the dense block and the shared expert."""

    def __init__(self, w: Weights, p: str):
        super().__init__()
        self.up_proj = w.linear(f"{p}.up_proj")
        self.down_proj = w.linear(f"{p}.down_proj")

    def __call__(self, x):
        return self.down_proj(nn.relu2(self.up_proj(x)))


class MoE(nn.Module):
    """Sigmoid router; experts chosen on ``score + e_score_correction_bias`` (optionally
    within the best ``topk_group`` of ``n_group`` groups), weighted by the un-biased scores,
    normalized, times ``routed_scaling_factor``; plus one shared expert.

    A latent MoE (``moe_latent_size``: Nemotron 3 Super and Ultra) routes on the full hidden
    state, runs the routed experts and their weighted sum in the latent space between
    ``fc1_latent_proj`` (hidden -> latent) and ``fc2_latent_proj`` (back), and its shared
    expert on the unprojected input, as mlx-lm's and vLLM's ``NemotronHMoE`` do."""

    sort_min_tokens: int | None = None
    """Fewest tokens whose (token, expert) pairs are grouped by expert (None: by the device
    that runs, decided at each call). On a GPU every multi-token step (a verify) groups, so a
    shared expert is read once; on the CPU grouped verifies showed no consistent gain
    (docs/history/real-size.md), so it keeps mlx-lm's threshold (64 pairs at top-6). Sorting permutes rows only: outputs are equal either way
    (tests/test_moe_grouping.py)."""

    def __init__(self, cfg: TargetConfig, w: Weights, p: str):
        super().__init__()
        self.cfg = cfg
        # Named as the checkpoint names them (the weight-load gate of the MTP block relies on it)
        self.gate = nn.Module()
        self.gate.weight = w[f"{p}.gate.weight"].astype(mx.float32)
        self.gate.e_score_correction_bias = w[f"{p}.gate.e_score_correction_bias"].astype(
            mx.float32)
        self.experts = nn.Module()
        self.experts.up_proj = w.experts(f"{p}.experts.up_proj")
        self.experts.down_proj = w.experts(f"{p}.experts.down_proj")
        self.shared_experts = MLP(w, f"{p}.shared_experts")
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = w.linear(f"{p}.fc1_latent_proj")
            self.fc2_latent_proj = w.linear(f"{p}.fc2_latent_proj")

    def route(self, x):
        c = self.cfg
        scores = mx.sigmoid(x.astype(mx.float32) @ self.gate.weight.T)
        choice = scores + self.gate.e_score_correction_bias
        if c.n_group > 1:
            grouped = choice.reshape(*choice.shape[:-1], c.n_group, -1)
            gscore = mx.topk(grouped, 2, axis=-1).sum(axis=-1)
            drop = mx.argpartition(gscore, c.n_group - c.topk_group - 1, axis=-1)[
                ..., :c.n_group - c.topk_group]
            grouped = mx.put_along_axis(grouped, drop[..., None], mx.array(-mx.inf), axis=-2)
            choice = grouped.reshape(choice.shape)
        k = c.num_experts_per_tok
        idx = mx.argpartition(-choice, k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(scores, idx, axis=-1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return idx, weights * c.routed_scaling_factor

    def __call__(self, x):
        idx, weights = self.route(x)
        latent = "fc1_latent_proj" in self
        h = self.fc1_latent_proj(x) if latent else x
        xf = h.reshape(-1, 1, 1, h.shape[-1])
        idx_f = idx.reshape(-1, idx.shape[-1])
        # Several tokens: sort the (token, expert) pairs so each expert's rows are contiguous
        # and gather_qmm can read a shared expert once (a verify's tokens often share them).
        least = self.sort_min_tokens
        if least is None:
            least = 2 if on_gpu() else 11
        sort = idx_f.shape[0] >= least
        if sort:
            flat = idx_f.flatten()
            order = mx.argsort(flat)
            inv = mx.argsort(order)
            xs = xf[order // idx_f.shape[-1]]
            ids = flat[order][:, None]
        else:
            xs, ids = xf, idx_f
        y = self.experts.down_proj(nn.relu2(self.experts.up_proj(xs, ids, sort)), ids, sort)
        if sort:
            y = y[inv].reshape(*idx_f.shape, 1, -1)
        y = y.squeeze(-2).reshape(*idx.shape, -1)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2).reshape(h.shape)
        if latent:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, kind: str, cfg: TargetConfig, w: Weights, i: int):
        super().__init__()
        p = f"backbone.layers.{i}"
        self.kind = kind
        self.norm_weight = w.cast(f"{p}.norm.weight")
        self.eps = cfg.layer_norm_epsilon
        cls = {"M": Mamba2Mixer, "*": Attention, "E": MoE}.get(kind)
        self.mixer = cls(cfg, w, f"{p}.mixer") if cls else MLP(w, f"{p}.mixer")

    def __call__(self, x, cache, record):
        h = rms_norm(x, self.norm_weight, self.eps)
        if self.kind == "M":
            h = self.mixer(h, cache, record)
        elif self.kind == "*":
            h = self.mixer(h, cache)
        else:
            h = self.mixer(h)
        return x + h


# ------------------------------------------------------------------------------- model


class NemotronH(nn.Module):
    # how a long step is cut (decode/pieces.py cuts a prefill to compute the same to the bit)
    prefill_step, serial_max = PREFILL_STEP, SERIAL_MAX

    @property
    def scan_chunk(self) -> int:
        """The Mamba scan's chunk: a prefill may stop a whole number of them past its last
        stop without changing a bit (decode/pieces.py ``silent``)."""
        return self.config.chunk_size

    def __init__(self, cfg: TargetConfig, w: dict, dtype=None, nvfp4=None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype = dtype or default_dtype()
        w = w if isinstance(w, Weights) else Weights(w, dtype, nvfp4)
        # Kept as stored: decoding reads one row per token, upcast in embed().
        self.embeddings = w.embedding("backbone.embeddings")
        rows = (self.embeddings.weight if isinstance(self.embeddings, nn.Module)
                else self.embeddings).shape[0]
        if rows != cfg.vocab_size:       # token ids are checked against vocab_size
            raise ValueError(f"config.json: vocab_size {cfg.vocab_size} but the embedding table "
                             f"has {rows} rows")
        self.layers = [Block(c, cfg, w, i) for i, c in enumerate(cfg.hybrid_override_pattern)]
        self.norm_f = w.cast("backbone.norm_f.weight")
        if "lm_head.weight" in w:
            self.head = w.linear("lm_head")
        elif cfg.tie_word_embeddings:
            self.head = make_linear({"lm_head.weight": self.embeddings}, "lm_head", dtype)
        else:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")

    # --- pieces the drafter borrows
    def embed(self, tokens):
        e = self.embeddings         # a table, or a quantized one (mlx-lm's layout)
        return (e(tokens) if isinstance(e, nn.Module) else e[tokens]).astype(self.dtype)

    def lm_head(self, h):
        return self.head(h)

    # --- forward passes
    def _forward(self, tokens, cache, tap_layers, record, last_only=False, also=0):
        if tokens.ndim == 1:
            tokens = tokens[None]
        bad = [i for i in tap_layers or () if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"tap layers {bad} outside 0..{len(self.layers) - 1}")
        # [1, T, hidden]: embeddings with media rows in them (models/media_rows.py)
        x = self.embed(tokens) if tokens.ndim == 2 else tokens
        taps = {}
        want = set(tap_layers or ())
        for i, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache[i], record)
            if i in want:
                taps[i] = x
        logits = self._head(x[:, -1:] if last_only else x)
        if last_only and also:      # rows scored, not chosen from: apart, so that the last
            logits = mx.concatenate([self._head(x[:, -1 - also:-1]), logits], axis=1)  # stays
        if cache is not None:
            cache.advance(tokens.shape[1])
        if not tap_layers:
            return logits, None
        t = mx.concatenate([taps[i] for i in tap_layers], axis=-1)
        return logits, (t[0] if t.shape[0] == 1 else t)

    def _head(self, x):
        return self.lm_head(rms_norm(x, self.norm_f, self.config.layer_norm_epsilon))

    def __call__(self, tokens):
        """Full forward without cache: ``tokens [1, T] -> logits [1, T, V]``."""
        return self._forward(tokens, None, None, False)[0]

    @property
    def context_limit(self) -> int | None:
        """Maximum sequence length the config declares (max_position_embeddings), if any."""
        limit = self.config.extra.get("max_position_embeddings")
        return None if limit is None else int(limit)

    def make_cache(self) -> TargetCache:
        return TargetCache(self.config.hybrid_override_pattern)

    def step(self, tokens, cache: TargetCache, tap_layers=None, last_only=False, also=0):
        """Advance ``cache`` by ``tokens [1, T]``; returns ``(logits [1,T,V], taps)``, or
        logits ``[1,1,V]`` for the last position alone with ``last_only`` (a prompt: the
        head then runs on one row, so memory does not grow with the prompt's length), after
        the ``also`` positions before it (``[1,also+1,V]``; the head runs on those apart, so
        the last row is the one ``last_only`` computes, to the bit)."""
        if cache.pending is not None:
            raise RuntimeError("commit() the last verify before stepping again")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.shape[1] <= PREFILL_STEP:
            return self._forward(tokens, cache, tap_layers, False, last_only, also)
        if also:
            raise ValueError(f"also={also}: only a step of at most {PREFILL_STEP} tokens")
        pieces = []
        for s in range(0, tokens.shape[1], PREFILL_STEP):
            piece = tokens[:, s:s + PREFILL_STEP]
            pieces.append(self._forward(piece, cache, tap_layers, False, last_only))
            mx.eval(pieces[-1])                  # free this piece's scores before the next
        logits = pieces[-1][0] if last_only else mx.concatenate([p[0] for p in pieces], axis=1)
        taps = mx.concatenate([p[1] for p in pieces], axis=-2) if tap_layers else None
        return logits, taps

    def verify(self, tokens, cache: TargetCache, tap_layers=None):
        """Like :meth:`step` over ``[bonus, d1..dN]``, remembering what :meth:`commit`
        needs to keep any prefix."""
        if cache.pending is not None:
            raise RuntimeError("commit() the last verify before verifying again")
        out = self._forward(tokens, cache, tap_layers, True)
        cache.pending = tokens.shape[-1]
        return out

    def step_rows(self, tokens, caches: list[TargetCache], tap_layers=None, verify=False):
        """Rows decoded together (docs/batching.md): row ``i`` of ``tokens [B, T]`` advances
        ``caches[i]``, each sequence's own cache, in one forward; ``(logits [B, T, V], taps
        [B, T, n*hidden] or None)``. With ``verify`` each row is a :meth:`verify` that
        ``commit(caches[i], n_i)`` cuts back on its own. Each row computes what it computes
        alone, to the bit where the backend's matmuls do not depend on the row count."""
        if any(c.pending is not None for c in caches):
            raise RuntimeError("commit() every row's last verify before stepping again")
        logits, taps = self._forward(tokens, RowsCache(caches), tap_layers, verify)
        for c in caches if verify else ():
            c.pending = tokens.shape[1]
        return logits, None if taps is None else taps.reshape(*tokens.shape, -1)

    def commit(self, cache: TargetCache, n: int):
        """Keep the first ``n`` (1 <= n <= N+1) positions of the last verify."""
        t = cache.pending
        if t is None:
            raise RuntimeError("commit() without a verify")
        if not 1 <= n <= t:
            raise ValueError(f"commit({n}) outside 1..{t}")
        cache.pending = None
        drop = t - n
        for layer, c in zip(self.layers, cache.layers):
            if isinstance(c, KVCache):
                c.offset -= drop
            elif isinstance(c, MambaCache):
                c.commit(n, layer.mixer.A)
        cache.offset -= drop


# ------------------------------------------------------------------------------- loading


_DTYPE_NAMES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32,
                "bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}


def compute_dtype(dtype) -> mx.Dtype:
    """A compute dtype from what callers pass: None (:func:`default_dtype`), an MLX float
    dtype, or its name (``"bfloat16"``, the CLI's spelling; ``"bf16"``, ...)."""
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in (mx.bfloat16, mx.float16, mx.float32):
        return dtype
    raise ValueError(f"dtype must be 'bfloat16', 'float16' or 'float32' (or mx.bfloat16, ...), "
                     f"not {dtype!r}")


def default_dtype():
    """bf16 on a GPU (any MLX GPU backend). float32 on MLX's CPU backend, where it is the
    faster choice (measured, docs/history/measurements.md): the CPU nvfp4 kernels and ``gather_qmm``
    are several times slower with bf16 activations, ``gather_mm`` accepts only float32, and
    only float32 matmuls go through BLAS."""
    return mx.bfloat16 if on_gpu() else mx.float32


def stack_experts(w: dict, n_layers: int, layers: str = "backbone.layers") -> dict:
    """HF-format checkpoints keep one tensor set per expert; stack them on a leading axis
    (converted checkpoints arrive stacked already)."""
    for i in range(n_layers):
        p = f"{layers}.{i}.mixer.experts"
        for proj in ("up_proj", "down_proj"):
            if f"{p}.0.{proj}.weight" not in w:
                if f"{p}.{proj}" in w:                    # transformers' in-memory name
                    w[f"{p}.{proj}.weight"] = w.pop(f"{p}.{proj}")
                continue
            suffixes = sorted({k[len(f"{p}.0.{proj}."):] for k in w
                               if k.startswith(f"{p}.0.{proj}.")})
            e = 0
            while f"{p}.{e}.{proj}.weight" in w:
                e += 1
            for s in suffixes:
                w[f"{p}.{proj}.{s}"] = mx.stack([w.pop(f"{p}.{j}.{proj}.{s}")
                                                 for j in range(e)])
    return w


def load_target(path: str, dtype=None, nvfp4: str | None = None,
                verify: str = "auto") -> NemotronH:
    """Load a Nemotron-H directory in any layout that loads (checkpoint/formats.py): converted
    by ``mlx-dspark convert``, mlx-lm's (models/mlx_lm_layout.py), or a plain HF download.

    ``dtype``: compute dtype or its name, default :func:`default_dtype`. ``nvfp4``: ``"quantized"``
    or ``"dequantized"`` compute for NVFP4 linears (default quant.NVFP4_POLICY); routed experts
    always stay packed (quant.make_experts). ``verify``: how much of the files is checked first
    (checkpoint/integrity.py): against the conversion receipt, or for a directory that came
    without one against the hashes taken at its first load (checkpoint/recorded.py); a
    converted directory without a receipt needs ``verify="none"``."""
    dtype = compute_dtype(dtype)
    fmt = detect_dir(path)          # what cannot run is refused before anything is read
    raw = read_target_config(path)
    cfg_path = os.path.join(path, "config.json")
    if fmt.layout == "modelopt":
        # ModelOpt's own layout (U8 nibbles, F8 block scales) is not ours: refuse rather than
        # misread NVFP4 block scales as FP8 weights.
        raise ValueError(convert_first(path, fmt))
    cfg = TargetConfig.from_dict(raw, cfg_path)
    check_shapes(path, raw, cfg, fmt)
    reads = check_files(path, verify, require_receipt=fmt.layout == "mlx-dspark")
    w = read_weights(path, reads, keep=lambda name: not name.startswith("mtp."))[0]
    if fmt.layout == "mlx-lm":
        w = mlx_lm_weights(w, raw, cfg, dtype)
    else:
        w = stack_experts(w, cfg.num_hidden_layers)
    try:
        model = NemotronH(cfg, w, dtype, nvfp4)
    except KeyError as e:
        raise ValueError(f"{path}: tensor {e.args[0]} missing from the checkpoint ({fmt})") \
            from None
    if fmt.layout == "mlx-lm":
        w.check_all_used(path)
    del w
    _materialize(model)
    model.path = path          # where a drafter that lives in the target's files reads them
    model.format = fmt
    return model


def check_shapes(path, raw: dict, cfg: TargetConfig, fmt) -> None:
    """Every shape-bearing value of ``raw`` (parsed: ``cfg``) against the tensors the
    safetensors headers of ``path`` declare, before any weight is read: the tensors decide,
    and a config that says otherwise is refused in one line naming config.json and the field."""
    cfg_path = os.path.join(path, "config.json")
    shapes = tensor_shapes(path)
    latent = latent_problem(raw, shapes, cfg_path)
    if latent:
        raise CheckpointError(latent)
    check_tensors(cfg.values(), cfg.hybrid_override_pattern, shapes, cfg_path)
    if fmt.layout != "hf" and isinstance(raw.get("quantization"), dict):
        check_quantization(raw["quantization"], shapes, fmt.layout, cfg_path)


def _materialize(model: NemotronH) -> None:
    """Evaluate the parameters a layer at a time. The model holds the only references to the
    loaded tensors, so each original (e.g. a BF16 weight upcast to fp32, FP8 bytes decoded)
    is freed as soon as its converted copy exists: the peak is the loaded model plus about
    one layer, never two copies of the weights."""
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
