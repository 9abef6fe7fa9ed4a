"""The DSpark drafter's ``config.json``: NVIDIA's ``Qwen3DSparkModel`` fields parsed into a
``DrafterConfig``, variants this runtime does not implement refused, the fit with a target
checked, and the tensors the config implies checked against the checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..converter.layout import GROUP_SIZE, speculators_refusal
from ..converter.shapes import check_drafter
from ..models.quant import module_format
from ..models.weights import _FLOATS
from .base import DrafterError, target_dims

ARCHITECTURES = ("Qwen3DSparkModel",)


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


def check_convention(cfg: dict, where: str) -> None:
    """Refuse by name a drafter saved in vllm-project/speculators' convention, whose block
    slots and tap layers are offset from NVIDIA's (converter/layout.speculators_refusal)."""
    refusal = speculators_refusal(cfg, where)
    if refusal:
        raise DrafterError(refusal)


def parse_config(cfg: dict, where: str = "config.json") -> DrafterConfig:
    """Parse NVIDIA's DSpark ``config.json``; refuse variants this runtime does not implement."""
    check_convention(cfg, where)
    archs = cfg.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
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
    check_drafter(cfg, where)
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

    return DrafterConfig(**backbone_fields(cfg, where, block_default=0),
                         markov_rank=int(rank),
                         has_embed_tokens=bool(cfg.get("has_embed_tokens", True)))


def backbone_fields(cfg: dict, where: str, block_default: int) -> dict:
    """The fields of the block backbone DSpark and DFlash share (:class:`DrafterConfig` less
    the Markov rank and the embedding flag), from a Qwen3-style drafter config."""
    vocab = int(cfg["vocab_size"])
    n_layers = int(cfg["num_hidden_layers"])
    theta, windows = attention_shape(cfg, where, n_layers)
    block_size = int(_pick(cfg, ["block_size"], where, block_default))
    if block_size < 2:
        raise DrafterError(f"{where}: block_size {block_size} (need >= 2)")
    mask_id = _pick(cfg, ["mask_token_id"], where)
    if mask_id is None or not 0 <= int(mask_id) < vocab:
        raise DrafterError(f"{where}: mask_token_id {mask_id} not in [0, {vocab})")
    heads = int(cfg["num_attention_heads"])
    return dict(
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=vocab,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        windows=windows,
        attention_sinks=bool(_pick(cfg, ["attention_sink_bias"], where, False)),
        block_size=block_size,
        mask_token_id=int(mask_id),
        target_layer_ids=tuple(int(i) for i in tap_layers(cfg, where)),
        target_hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
    )

def attention_shape(cfg: dict, where: str, n_layers: int) -> tuple[float, tuple]:
    """``(rope_theta, windows)`` of a Qwen3-style drafter: plain RoPE only; per layer its
    sliding window in keys, or None for full attention."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _unsupported(where, f"rope type {rope_type!r} (plain RoPE only)")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise DrafterError(f"{where}: no rope_theta")
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
    return float(theta), tuple(windows)


def tap_layers(cfg: dict, where: str) -> list:
    """The 0-based target layers tapped: ``target_layer_ids`` (top level or dflash_config),
    else vLLM's ``eagle_aux_hidden_state_layer_ids``, which count layers done (= ours + 1)."""
    ids = _pick(cfg, ["target_layer_ids"], where)
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and eagle is not None:
        ids = [i - 1 for i in eagle]
    if not ids:
        raise DrafterError(f"{where}: no target_layer_ids (or eagle_aux_hidden_state_layer_ids)")
    if eagle is not None and [i + 1 for i in ids] != list(eagle):
        raise DrafterError(f"{where}: target_layer_ids {ids} and eagle_aux_hidden_state_layer_ids"
                           f" {eagle} disagree (the eagle ids must be target_layer_ids + 1)")
    return ids


def check_fits(cfg: DrafterConfig, target, where: str):
    """Refuse a drafter that was not built for this target."""
    hidden, vocab, layers = target_dims(target)
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


def _expected_linears(cfg: DrafterConfig) -> dict:
    """prefix -> (out, in) for every linear module of the drafter."""
    h, hd = cfg.hidden_size, cfg.head_dim
    lin = {"fc": (h, h * len(cfg.target_layer_ids))}
    if cfg.markov_rank:
        lin["markov_head.markov_w2"] = (cfg.vocab_size, cfg.markov_rank)
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
    shapes = {"hidden_norm.weight": (h,), "norm.weight": (h,)}
    if cfg.markov_rank:
        shapes["markov_head.markov_w1.weight"] = (cfg.vocab_size, cfg.markov_rank)
    if cfg.has_embed_tokens:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
        if cfg.attention_sinks:
            shapes[f"{p}.self_attn.attention_sink_bias"] = (cfg.num_heads,)
    return shapes


def check_tensors(cfg: DrafterConfig, weights: dict, origin: dict, path: str, declared: dict,
                  layout: str = "NVIDIA's DSpark layout"):
    """Every expected tensor present with the right dtype and shape, nothing unexpected
    (``layout``: what the message calls the kind's tensor layout)."""
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
                           f" (not part of {layout} as configured)")
