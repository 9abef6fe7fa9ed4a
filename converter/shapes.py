"""The shape-bearing values of a Nemotron-H target's ``config.json``, checked on their own and
then against the tensors (their shapes from the safetensors headers, before any weight is
read): the tensors decide, the config only describes them. Every layout: mlx-dspark's
converted one and ``convert``'s plan of a ModelOpt export (stacked experts), mlx-lm's
(``switch_mlp``, MLX quantization under ``quantization``) and a plain Hugging Face download
(one tensor set per expert). A linear's rows are its output features whatever its packing,
so rows are what is compared.

Each refusal is one line naming ``config.json``, the field and what the tensors say instead.
MLX-free (``convert`` runs the same checks on what it is about to write)."""

from __future__ import annotations

import math
import re

from .layout import GROUP_SIZE, decode_float, mtp_pattern

MLX_SCHEMES = frozenset([*(("affine", b, g) for b in (1, 2, 3, 4, 5, 6, 8) for g in (32, 64, 128)),
                         ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
"""(mode, bits, group_size) that MLX quantizes (``mx.quantize`` accepts exactly these)."""
_SCHEME_KEYS = ("group_size", "bits", "mode")
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^backbone\.layers\.\d+\.mixer\.experts\.(\d+)\.up_proj\.weight$")
_KIND_TENSOR = {"M": "mixer.A_log", "*": "mixer.q_proj.weight", "E": "mixer.gate.weight",
                "-": "mixer.up_proj.weight"}
_KIND_NAME = {"M": "Mamba-2", "*": "attention", "E": "MoE", "-": "dense MLP"}
_SIZES = {"M": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                "conv_kernel", "chunk_size"),
          "*": ("num_attention_heads", "num_key_value_heads"),
          "E": ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size"),
          "-": ("intermediate_size",)}
"""Per block kind, the sizes it is built from: integers >= 1 wherever the kind is used."""


class ConfigError(ValueError):
    """A config value that contradicts itself or the tensors: the message names the file and
    the field."""


def _positive(v) -> bool:
    return type(v) is int and v >= 1


def check_values(cfg: dict, pattern: str, where) -> None:
    """The values of ``cfg`` (those present: a loader passes them with its defaults filled in)
    that shapes depend on, plausible on their own: sizes integers >= 1 where ``pattern`` (and
    the MTP block's) uses them, heads and groups that divide, 1 <= top-k <= experts, a finite
    positive epsilon, ``max_position_embeddings`` >= 1 when given."""
    def bad(field, why):
        return ConfigError(f"{where}: {field} {cfg.get(field)!r}: {why}")

    kinds = set(pattern)
    try:
        kinds |= set(mtp_pattern(cfg))
    except ValueError:
        pass                                   # the MTP drafter's load names a bad pattern
    wanted = ["vocab_size", "hidden_size"] + [f for k in sorted(kinds) for f in _SIZES[k]]
    for field in wanted:
        if field in cfg and not _positive(cfg[field]):
            raise bad(field, "must be an integer >= 1")
    if cfg.get("head_dim") is not None and not _positive(cfg["head_dim"]):
        raise bad("head_dim", "must be an integer >= 1 (or absent)")
    limit = cfg.get("max_position_embeddings")
    if limit is not None and not (_positive(limit) and limit >= 2):
        raise bad("max_position_embeddings", "must be an integer >= 2, room for a prompt and a "
                                             "token (or absent: no limit; 0 is no 'no limit')")
    if "num_hidden_layers" in cfg and cfg["num_hidden_layers"] != len(pattern):
        raise bad("num_hidden_layers", f"but the layer pattern {pattern!r} has "
                                       f"{len(pattern)} layers")
    if not pattern:
        raise ConfigError(f"{where}: hybrid_override_pattern is empty: no layers")
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise bad("layer_norm_epsilon", "must be a finite number > 0")
    for field in ("tie_word_embeddings", "norm_topk_prob"):
        if field in cfg and not isinstance(cfg[field], bool):
            raise bad(field, "must be true or false")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise bad("routed_scaling_factor", "must be a finite number")
    get = cfg.get
    if "*" in kinds:
        nh, nkv = get("num_attention_heads", 1), get("num_key_value_heads", 1)
        if nh % nkv:
            raise bad("num_key_value_heads", f"does not divide num_attention_heads {nh}")
        if get("head_dim") is None and get("hidden_size", nh) % nh:
            raise bad("num_attention_heads", f"does not divide hidden_size "
                                             f"{get('hidden_size')} (and no head_dim)")
    if "M" in kinds and get("mamba_num_heads", 1) % get("n_groups", 1):
        raise bad("n_groups", f"does not divide mamba_num_heads {get('mamba_num_heads')}")
    if "E" in kinds:
        experts, groups = get("n_routed_experts", 1), get("n_group", 1)
        if not get("num_experts_per_tok", 1) <= experts:
            raise bad("num_experts_per_tok", f"must be between 1 and n_routed_experts {experts}")
        if experts % groups:
            raise bad("n_group", f"does not divide n_routed_experts {experts}")
        if not get("topk_group", 1) <= groups:
            raise bad("topk_group", f"must be between 1 and n_group {groups}")
        if groups > 1 and (experts // groups < 2 or get("num_experts_per_tok", 1)
                           > get("topk_group", 1) * (experts // groups)):
            raise bad("n_group", f"leaves too few experts per group for num_experts_per_tok "
                                 f"{get('num_experts_per_tok')} in topk_group "
                                 f"{get('topk_group')} (each group needs >= 2)")
    limit = get("time_step_limit")
    try:
        low, high = (decode_float(v) for v in limit) if limit is not None else (0, 0)
    except (TypeError, ValueError):
        low = math.nan
    if not 0 <= low <= high:
        raise bad("time_step_limit", "must be [low, high] with 0 <= low <= high")


def check_tensors(cfg: dict, pattern: str, shapes: dict, where) -> None:
    """``cfg`` (values as :func:`check_values` takes them) against ``shapes`` (tensor name ->
    shape, any layout): the vocabulary against the embedding's and lm_head's rows, the layer
    pattern against the layers the tensors hold, and each block's sizes against its
    tensors'."""
    def rows(name):
        shape = shapes.get(name)
        return shape[0] if shape else None

    def differs(said, value, name, got, what="rows"):
        """``said``: the config's fields and values that make ``value``."""
        if got is not None and got != value:
            raise ConfigError(f"{where}: {said} but the checkpoint's {name} has {got} {what}")

    vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
    for name in ("backbone.embeddings.weight", "lm_head.weight"):
        differs(f"vocab_size {vocab}", vocab, name, rows(name))
    differs(f"hidden_size {hidden}", hidden, "backbone.norm_f.weight",
            rows("backbone.norm_f.weight"), "entries")
    layers = sorted({int(m[1]) for n in shapes if (m := _LAYER.match(n))})
    if layers and layers != list(range(len(pattern))):
        raise ConfigError(f"{where}: hybrid_override_pattern {pattern!r} declares "
                          f"{len(pattern)} layers but the checkpoint's tensors hold layers "
                          f"{_spans(layers)}")
    for i, kind in enumerate(pattern if layers else ""):
        p = f"backbone.layers.{i}"
        found = [k for k, t in _KIND_TENSOR.items() if f"{p}.{t}" in shapes
                 or (k == "E" and f"{p}.mixer.switch_mlp.fc1.weight" in shapes)]
        if found and kind not in found:
            raise ConfigError(f"{where}: hybrid_override_pattern {pattern!r}: layer {i} is "
                              f"{kind!r} ({_KIND_NAME[kind]}) but its tensors are "
                              f"{_KIND_NAME[found[0]]}'s ({p}.{_KIND_TENSOR[found[0]]})")
        _block(cfg, kind, f"{p}.mixer", shapes, rows, differs)


def _block(cfg, kind, p, shapes, rows, differs) -> None:
    get, hidden = cfg.get, cfg.get("hidden_size")
    if kind == "M":
        h, hp = get("mamba_num_heads", 128), get("mamba_head_dim", 64)
        g, n = get("n_groups", 8), get("ssm_state_size", 128)
        heads = f"mamba_num_heads {h} x mamba_head_dim {hp}"
        groups = f"n_groups {g} x ssm_state_size {n}"
        differs(f"mamba_num_heads {h}", h, f"{p}.A_log", rows(f"{p}.A_log"), "entries")
        differs(heads, h * hp, f"{p}.norm.weight", rows(f"{p}.norm.weight"), "entries")
        conv = shapes.get(f"{p}.conv1d.weight")
        differs(f"{heads} + 2 x {groups}", h * hp + 2 * g * n, f"{p}.conv1d.weight",
                conv and conv[0])
        differs(f"conv_kernel {get('conv_kernel', 4)}", get("conv_kernel", 4),
                f"{p}.conv1d.weight", conv and math.prod(conv[1:]), "taps")
        differs(f"2 x {heads} + 2 x {groups} + mamba_num_heads", 2 * h * hp + 2 * g * n + h,
                f"{p}.in_proj.weight", rows(f"{p}.in_proj.weight"))
        differs(f"hidden_size {hidden}", hidden, f"{p}.out_proj.weight",
                rows(f"{p}.out_proj.weight"))
    elif kind == "*":
        nh, nkv = get("num_attention_heads", 32), get("num_key_value_heads", 8)
        hd = get("head_dim") or (hidden or 0) // nh
        differs(f"num_attention_heads {nh} x head_dim {hd}", nh * hd, f"{p}.q_proj.weight",
                rows(f"{p}.q_proj.weight"))
        for proj in ("k_proj", "v_proj"):
            differs(f"num_key_value_heads {nkv} x head_dim {hd}", nkv * hd,
                    f"{p}.{proj}.weight", rows(f"{p}.{proj}.weight"))
        differs(f"hidden_size {hidden}", hidden, f"{p}.o_proj.weight", rows(f"{p}.o_proj.weight"))
    elif kind == "E":
        experts, inner = get("n_routed_experts", 0), get("moe_intermediate_size", 0)
        said = f"n_routed_experts {experts}"
        differs(said, experts, f"{p}.gate.weight", rows(f"{p}.gate.weight"))
        for name in (f"{p}.experts.up_proj.weight", f"{p}.switch_mlp.fc1.weight"):
            stacked = shapes.get(name) or ()
            differs(said, experts, name, stacked[0] if stacked else None, "experts")
            differs(f"moe_intermediate_size {inner}", inner, name,
                    stacked[1] if len(stacked) > 1 else None, "rows per expert")
        each = {int(m[1]) for n in shapes if (m := _EXPERT.match(n)) and n.startswith(p + ".")}
        differs(said, experts, f"{p}.experts.*.up_proj.weight",
                max(each) + 1 if each else None, "experts")
        shared = get("moe_shared_expert_intermediate_size", 0)
        differs(f"moe_shared_expert_intermediate_size {shared}", shared,
                f"{p}.shared_experts.up_proj.weight", rows(f"{p}.shared_experts.up_proj.weight"))
    else:
        inner = get("intermediate_size", 0)
        differs(f"intermediate_size {inner}", inner, f"{p}.up_proj.weight",
                rows(f"{p}.up_proj.weight"))


def _spans(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0..2, 5``."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    return ", ".join(out)


def scheme_problem(entry, top: dict | None = None) -> str | None:
    """Why ``entry`` is no MLX quantization of a module as mlx-lm reads one (a dict of
    group_size, bits and mode, ``false`` for a float module, ``true`` for the defaults
    ``top``), or None."""
    if isinstance(entry, bool):
        return None if not entry or top is not None else "true is only meaningful per module"
    if not isinstance(entry, dict):
        return f"must be an object of {', '.join(_SCHEME_KEYS)} (or false), not {entry!r:.60}"
    extra = sorted(set(entry) - set(_SCHEME_KEYS))
    if extra:
        return f"has {extra[0]!r}, which MLX quantization does not take"
    scheme = (entry.get("mode", "affine"), entry.get("bits"), entry.get("group_size"))
    if scheme not in MLX_SCHEMES:
        return (f"mode {scheme[0]!r} at {scheme[1]!r} bits in groups of {scheme[2]!r} is no MLX "
                f"quantization (affine: 1-6 or 8 bits, groups of 32, 64 or 128; mxfp4 4/32; "
                f"nvfp4 4/16; mxfp8 8/32)")
    return None


def check_quantization(quantization, shapes: dict, layout: str, where) -> None:
    """``config.json``'s ``quantization``: mlx-lm's (defaults an MLX scheme, every other key a
    module of the checkpoint with its own scheme or false) or mlx-dspark's (group size
    ``GROUP_SIZE``, ``modules`` naming modules that exist)."""
    modules = {n[:-len(".weight")] for n in shapes if n.endswith(".weight")}
    if layout == "mlx-dspark":
        if quantization.get("group_size", GROUP_SIZE) != GROUP_SIZE:
            raise ConfigError(f"{where}: quantization.group_size "
                              f"{quantization['group_size']!r}: the converted layout's NVFP4 "
                              f"groups are {GROUP_SIZE}")
        listed = quantization.get("modules") or {}
        if not isinstance(listed, dict):
            raise ConfigError(f"{where}: quantization.modules must be an object")
        for name, kind in listed.items():
            if name not in modules or not isinstance(kind, str):
                raise ConfigError(f"{where}: quantization.modules[{name!r}] {kind!r:.40}: "
                                  + ("no such module in the checkpoint" if name not in modules
                                     else "must be a string"))
        return
    top = {k: quantization[k] for k in _SCHEME_KEYS if k in quantization}
    problem = scheme_problem(top)
    if problem:
        raise ConfigError(f"{where}: quantization {problem}")
    for name, entry in quantization.items():
        if name in _SCHEME_KEYS:
            continue
        if name not in modules:
            raise ConfigError(f"{where}: quantization[{name!r}]: no such module in the "
                              f"checkpoint (no {name}.weight)")
        problem = scheme_problem(entry, top)
        if problem:
            raise ConfigError(f"{where}: quantization[{name!r}] {problem}")


def check_drafter(cfg: dict, where) -> None:
    """A drafter's (DSpark, DFlash, EAGLE-3: Qwen3/Llama-style) sizes, plausible on their own
    before its tensors are sized by them: integers >= 1, key/value heads dividing the heads,
    a finite positive epsilon and RoPE base."""
    def bad(field, why):
        return ConfigError(f"{where}: {field} {cfg.get(field)!r}: {why}")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads"):
        if not _positive(cfg.get(field)):
            raise bad(field, "must be an integer >= 1")
    for field in ("num_key_value_heads", "head_dim", "target_hidden_size", "draft_vocab_size"):
        if cfg.get(field) is not None and not _positive(cfg[field]):
            raise bad(field, "must be an integer >= 1 (or absent)")
    heads = cfg["num_attention_heads"]
    if heads % cfg.get("num_key_value_heads", heads):
        raise bad("num_key_value_heads", f"does not divide num_attention_heads {heads}")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise bad("num_attention_heads", f"does not divide hidden_size {cfg['hidden_size']} "
                                         f"(and no head_dim)")
    for field in ("rms_norm_eps", "rope_theta"):
        v = cfg.get(field, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise bad(field, "must be a finite number > 0")
