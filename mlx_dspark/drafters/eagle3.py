"""An EAGLE-3 head (``LlamaForCausalLMEagle3``, the layout SpecForge trains and vLLM serves) as
a drafter.

As vLLM's ``llama_eagle3`` defines it, for the row of position ``p`` (the target's features of
``p``, the token after it):

    g_p  = fc([a_1 ; a_2 ; a_3])          the target's auxiliary hidden states (our taps)
    x    = [input_layernorm(embed(t_{p+1})) ; hidden_norm(g_p)]     (2 * hidden wide)
    r    = g_p + attn(x)                  Llama attention, rotate-half RoPE at position p
    out  = r + mlp(post_attention_layernorm(r))                   SwiGLU
    logits = d2t-scatter(lm_head(norm(out)))   draft vocabulary -> target ids, -inf elsewhere

(``norm_before_residual``: the residual is ``hidden_norm(g_p)`` instead of ``g_p``.) Drafting
more tokens reuses the layer with ``out`` (before ``norm``) as the next row's ``g``, at the next
position, as vLLM does. ``eagle_aux_hidden_state_layer_ids`` count layers done by default
(vLLM's convention, and the index of Hugging Face's ``hidden_states``): id ``i`` taps the
output of layer ``i - 1``. Heads trained for SGLang count one later (SGLang captures before
layer ``i + 1``: id ``i`` is the output of layer ``i``); a head says so with
``eagle_aux_hidden_state_layer_ids_convention: "sglang"`` (in ``eagle_config`` or at the top
level; :data:`CONVENTIONS`). No upstream config names the convention, and guessing it from
the ids (SGLang reads a first id of 1 as its own) cannot tell a vLLM head that taps layer 0
from an SGLang one: the field is explicit, and a head whose taps fall outside the target is
refused naming the file and the field. The embedding is the target's unless the head carries
its own (and then the target's is used when the two are bit-identical).

As for the MTP block (drafters/mtp.py), a context row waits for the token after it (``last``), only
``add_context`` writes the cache, and a proposal's own rows are scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..converter.plan import EAGLE3_ARCHITECTURES
from ..converter.shapes import check_drafter
from ..models.cache import KVCache
from ..models.layers import Norm
from ..models.quant import Weights
from ..models.weights import through_gate
from .base import DrafterBase, DrafterError, Draw, draft_dtype, read_converted, \
    shares_embedding, target_dims

ARCHITECTURES = EAGLE3_ARCHITECTURES     # the converter tells an EAGLE-3 export by the same names
MAX_DRAFT = 16
"""Most tokens one proposal drafts (the head has no limit of its own; see mtp.MAX_DRAFT)."""

CONVENTION_FIELD = "eagle_aux_hidden_state_layer_ids_convention"
CONVENTIONS = {"vllm": 1, "sglang": 0}
"""How a head counts its auxiliary layers: what to subtract from an id for the 0-based target
layer whose output it taps. "vllm" (the default): layers done; "sglang": one later."""
DEFAULT_CONVENTION = "vllm"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int             # the target's
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple     # 0-based target layers tapped (eagle ids - CONVENTIONS[...])
    target_hidden_size: int
    norm_before_residual: bool
    declared_ids: tuple = ()    # eagle_aux_hidden_state_layer_ids as the config gives them
    convention: str = DEFAULT_CONVENTION


def parse_config(cfg: dict, where: str, target_layers: int) -> Eagle3Config:
    """SpecForge's / vLLM's EAGLE-3 ``config.json``; variants not implemented refused."""
    archs = cfg.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
        raise DrafterError(f"{where}: architectures {archs} is not an EAGLE-3 head "
                           f"({' or '.join(ARCHITECTURES)})")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise DrafterError(f"{where}: unsupported EAGLE-3 variant: num_hidden_layers "
                           f"{cfg['num_hidden_layers']} (one decoder layer only)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise DrafterError(f"{where}: unsupported EAGLE-3 variant: hidden_act "
                           f"{cfg['hidden_act']!r} (SwiGLU with silu only)")
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise DrafterError(f"{where}: unsupported EAGLE-3 variant: use_aux_hidden_state false")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise DrafterError(f"{where}: unsupported EAGLE-3 variant: rope type {rope_type!r} "
                           f"(plain RoPE only)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise DrafterError(f"{where}: unsupported EAGLE-3 variant: biases in attention or MLP")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    convention = eagle.get(CONVENTION_FIELD, cfg.get(CONVENTION_FIELD, DEFAULT_CONVENTION))
    if convention not in CONVENTIONS:
        raise DrafterError(f"{where}: {CONVENTION_FIELD} {convention!r} is not one of "
                           f"{', '.join(map(repr, CONVENTIONS))}")
    if ids is None:                              # vLLM's default choice of auxiliary layers
        ids, convention = [2, target_layers // 2, target_layers - 3], "vllm"
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DrafterError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of "
                           f"integers, not {ids!r}")
    check_drafter({"num_hidden_layers": 1, **cfg}, where)      # one layer when not said
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg["vocab_size"])
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=vocab,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        target_layer_ids=tuple(i - CONVENTIONS[convention] for i in ids),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        declared_ids=tuple(ids), convention=convention)


def check_fits(cfg: Eagle3Config, target, where: str):
    """Refuse a head that was not trained for this target (naming the mismatch)."""
    hidden, vocab, layers = target_dims(target)
    if cfg.target_hidden_size != hidden:
        raise DrafterError(f"{where}: EAGLE-3 head target_hidden_size {cfg.target_hidden_size} "
                           f"!= target hidden_size {hidden} (wrong drafter for this target)")
    if cfg.vocab_size != vocab:
        raise DrafterError(f"{where}: EAGLE-3 head vocab_size {cfg.vocab_size} != target "
                           f"vocab_size {vocab} (wrong drafter for this target)")
    if not all(0 <= i < layers for i in cfg.target_layer_ids):
        shift = CONVENTIONS[cfg.convention]
        raise DrafterError(f"{where}: eagle_aux_hidden_state_layer_ids "
                           f"{list(cfg.declared_ids)} out of range for a {layers}-layer target: "
                           f"counted the {cfg.convention} way ({CONVENTION_FIELD}), ids "
                           f"{shift}..{layers - 1 + shift} tap its layers 0..{layers - 1} "
                           f"(wrong drafter for this target, or a head that counts the other "
                           f"way and does not say so)")


def expected_tensors(cfg: Eagle3Config) -> dict:
    """name -> shape of every tensor of the layout (``embed_tokens`` and ``t2d`` optional)."""
    h, hd, m = cfg.hidden_size, cfg.head_dim, "midlayer"
    return {
        "fc.weight": (h, len(cfg.target_layer_ids) * cfg.target_hidden_size),
        f"{m}.input_layernorm.weight": (h,), f"{m}.hidden_norm.weight": (h,),
        f"{m}.post_attention_layernorm.weight": (h,),
        f"{m}.self_attn.q_proj.weight": (cfg.num_heads * hd, 2 * h),
        f"{m}.self_attn.k_proj.weight": (cfg.num_kv_heads * hd, 2 * h),
        f"{m}.self_attn.v_proj.weight": (cfg.num_kv_heads * hd, 2 * h),
        f"{m}.self_attn.o_proj.weight": (h, cfg.num_heads * hd),
        f"{m}.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        f"{m}.mlp.up_proj.weight": (cfg.intermediate_size, h),
        f"{m}.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
    }


def check_tensors(cfg: Eagle3Config, weights: dict, path: str):
    """Every tensor of the layout present with its shape (a quantized linear by its
    ``weight`` and ``scales`` shapes), nothing unexpected."""
    want = expected_tensors(cfg)
    optional = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                "t2d": (cfg.vocab_size,)}
    for name, shape in want.items():
        if name not in weights:
            raise DrafterError(f"{path}: missing tensor {name} (EAGLE-3 layout)")
    for name, w in weights.items():
        base = name.rsplit(".", 1)[0] + ".weight"
        shape = want.get(name, optional.get(name))
        if name.endswith((".scales", ".weight_scale", ".weight_scale_2")) and base in want:
            continue                                  # checked with their weight below
        if shape is None:
            raise DrafterError(f"{path}: unexpected tensor {name} (not part of the EAGLE-3 "
                               f"layout)")
        got = tuple(w.shape)
        if w.dtype == mx.uint32:                      # NVFP4: 8 codes per uint32
            got = got[:-1] + (got[-1] * 8,)
        if got != shape:
            raise DrafterError(f"{path}: tensor {name} has shape {tuple(w.shape)}, expected "
                               f"{shape}")


class Eagle3Drafter(DrafterBase):
    """Parameter names mirror the checkpoint's (the weight-load gate relies on it)."""

    label = "EAGLE-3"
    pairs_tokens = True         # a context row is the target's features and the token after
    max_draft = MAX_DRAFT
    context_keep = None         # full attention: every context row stays

    def __init__(self, cfg: Eagle3Config, w: dict, target, dtype, share_embedding: bool,
                 nvfp4: str | None = None):
        super().__init__(target, dtype, cfg, None if share_embedding else w["embed_tokens.weight"])
        wt = Weights(w, dtype, nvfp4)
        eps = cfg.rms_norm_eps
        self.fc = wt.linear("fc")
        m = self.midlayer = nn.Module()
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(m, n, Norm(wt.cast(f"midlayer.{n}.weight"), eps))
        m.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(m.self_attn, n, wt.linear(f"midlayer.self_attn.{n}"))
        m.mlp = nn.Module()
        for n in ("gate_proj", "up_proj", "down_proj"):
            setattr(m.mlp, n, wt.linear(f"midlayer.mlp.{n}"))
        self.norm = Norm(wt.cast("norm.weight"), eps)
        self.lm_head = wt.linear("lm_head")
        self.d2t = w["d2t"]
        if "t2d" in w:
            self.t2d = w["t2d"]
        # where each draft-vocabulary row goes in the target's vocabulary
        self._ids = mx.arange(cfg.draft_vocab_size) + self.d2t.astype(mx.int32)
        self._identity = cfg.draft_vocab_size == cfg.vocab_size and \
            not mx.any(self.d2t != 0).item()

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def tap_width(self) -> int:
        return self.config.target_hidden_size * len(self.config.target_layer_ids)

    def make_cache(self, start: int = 0) -> "Eagle3Cache":
        cache = Eagle3Cache()
        cache.length = start
        return cache

    def layer(self, ids, g, pos0: int, kv: KVCache):
        """``out [T, hidden]`` (before ``norm``) over rows (token ``ids [T]``, features
        ``g [T, hidden]``) at positions pos0..; appends their K/V to ``kv``."""
        cfg, m = self.config, self.midlayer
        t, hd = g.shape[0], cfg.head_dim
        e = m.input_layernorm(self._embed(ids))
        gn = m.hidden_norm(g)
        x = mx.concatenate([e, gn], axis=-1)[None]
        a = m.self_attn

        def heads(y, n):
            return y.reshape(1, t, n, hd).transpose(0, 2, 1, 3)

        q = mx.fast.rope(heads(a.q_proj(x), cfg.num_heads), hd, traditional=False,
                         base=cfg.rope_theta, scale=1.0, offset=pos0)
        k = mx.fast.rope(heads(a.k_proj(x), cfg.num_kv_heads), hd, traditional=False,
                         base=cfg.rope_theta, scale=1.0, offset=pos0)
        k, v = kv.update(k, heads(a.v_proj(x), cfg.num_kv_heads))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5,
                                                 mask="causal" if t > 1 else None)
        r = (gn if cfg.norm_before_residual else g) + \
            a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, t, -1))[0]
        h = m.post_attention_layernorm(r)
        return r + m.mlp.down_proj(nn.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))

    def logits(self, out):
        """Target-vocabulary logits ``[T, V]``: the draft vocabulary's at their target ids,
        -inf elsewhere."""
        z = self.lm_head(self.norm(out)).astype(mx.float32)
        if self._identity:
            return z
        full = mx.full((z.shape[0], self.config.vocab_size), -mx.inf, dtype=mx.float32)
        full[:, self._ids] = z
        return full

    def features(self, taps):
        """``g_p = fc(taps_p)``."""
        return self.fc(taps.astype(self.dtype))

    def context_rows(self, rows, ids, pos0: int, cache: "Eagle3Cache"):
        self.layer(ids, rows, pos0, cache.kv)

    def draft(self, bonus, n: int, draw: Draw, cache: "Eagle3Cache"):
        """The layer reused on its own output, from the newest context row: each draft's
        ``out`` is the next one's ``g``, one position on. Its rows are scratch, rewound
        after."""
        mark, g = cache.kv.offset, cache.last

        def row(j, prev):
            nonlocal g
            g = self.layer(prev, g, cache.length - 1 + j, cache.kv)
            return self.logits(g)

        out = draw.chain(row, bonus, n)
        cache.kv.offset = mark                      # the drafts' own rows are scratch
        return out


class Eagle3Cache:
    """The head's context: K/V of the committed rows, the features of the newest context
    token (``last``, waiting for the token after it), and ``length``."""

    def __init__(self):
        self.kv = KVCache()
        self.last = None
        self.length = 0

    def snapshot(self):
        kv = None if self.kv.keys is None else tuple(mx.contiguous(x) for x in self.kv.state())
        return self.length, self.last, kv

    def restore(self, state):
        self.length, self.last, kv = state
        self.kv = KVCache()
        if kv is not None:
            self.kv.update(*kv)

    def arrays(self) -> list[mx.array]:
        out = [] if self.last is None else [self.last]
        return out + ([] if self.kv.keys is None else list(self.kv.state()))


def fits(raw: dict, where: str, target) -> Eagle3Config:
    """The head's config ``raw`` parsed and fitted to ``target`` (its config an object or a
    dict), before any weight is read."""
    cfg = parse_config(raw, where, target_dims(target)[2])
    check_fits(cfg, target, where)
    return cfg


def load(source: str, target, *, dtype=None, verify: str = "auto", verbose: bool = False,
         nvfp4: str | None = None) -> Eagle3Drafter:
    """Load the converted EAGLE-3 head in the directory ``source`` for ``target`` through the
    weight-load gate (``dtype``, ``verify``, ``nvfp4``: as for DSpark, drafters/dspark.py)."""
    source, dtype = str(source), draft_dtype(dtype, target)

    _, cfg, weights, _ = read_converted(source, verify,
                                        lambda raw, where: fits(raw, where, target))
    check_tensors(cfg, weights, source)
    drafter = Eagle3Drafter(cfg, weights, target, dtype, shares_embedding(weights, target),
                            nvfp4)
    del weights
    return through_gate(drafter, source, verbose)
