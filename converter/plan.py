"""From source headers to the list of output tensors: every check happens here, before a
single byte is written, so bad input never leaves a partial output behind.

Layout rules (ARCHITECTURE.md, "Converted checkpoint layout"): NVFP4 weight U8 (out, in/2) ->
uint32 (out, in/8), weight_scale F8_E4M3 -> uint8 ``scales``, weight_scale_2 verbatim; FP8
weight -> uint8, weight_scale verbatim; dense tensors unchanged. Only dtype labels change:
every output byte is a source byte. Routed experts stack along a new leading axis.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import defaultdict
from itertools import islice
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import ConversionError
from .layout import GROUP_SIZE, latent_problem, speculators_refusal
from .omni import WRAPPER, tower_name
from .quant_config import QuantSpec
from .safetensors_io import OutTensor, TensorInfo, open_regular, read_chunks, read_header

TARGET, DRAFTER, EAGLE3 = "target", "drafter", "eagle3"
# DSpark's and DFlash's (z-lab's layout, NVIDIA's Lightning DFlash) share the tensor layout the
# "drafter" kind checks: fc, hidden_norm, layers.N.{self_attn,mlp}, norm, no "model." prefix.
DRAFTER_ARCHITECTURES = ("Qwen3DSparkModel", "DFlashDraftModel")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DENSE_DTYPES = {"BF16": "bf16", "F16": "float16", "F32": "float32"}
# Weight-only runtime: activation and KV-cache calibration scales have no use (docs/design.md §4).
DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
# AWQ / SVDQuant extras: the weights are only correct together with them.
_EXTRAS = re.compile(r"(\.pre_quant_scale|lora_[ab]|\.awq_\w+)$|svdquant", re.IGNORECASE)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")
_EMBEDDINGS = re.compile(r"(^|\.)(embeddings|embed_tokens)$")
# The E4M3 bytes a block scale may hold: 0x7F and 0xFF are NaN, the sign bit makes it negative.
# Zero is valid: ModelOpt gives an all-zero block a zero scale.
_E4M3_OK = bytes(range(0x7F))
MAX_INDEX_DIGITS = 9               # layer and expert numbers: no real model has 10^9 of either
# config key -> (tensor name pattern, axis) whose size it must equal, per model kind
SIZE_CHECKS = {
    "target": {"vocab_size": (r"backbone\.embeddings\.weight", 0),
               "hidden_size": (r"backbone\.embeddings\.weight", 1),
               "moe_intermediate_size": (r"backbone\.layers\.\d+\.mixer\.experts\.\d+\.up_proj"
                                         r"\.weight", 0)},
    "drafter": {"vocab_size": (r"embed_tokens\.weight", 0),
                "hidden_size": (r"embed_tokens\.weight", 1),
                "intermediate_size": (r"layers\.\d+\.mlp\.up_proj\.weight", 0)},
    "eagle3": {"vocab_size": (r"embed_tokens\.weight", 0),
               "hidden_size": (r"midlayer\.input_layernorm\.weight", 0),
               "draft_vocab_size": (r"lm_head\.weight", 0),
               "intermediate_size": (r"midlayer\.mlp\.up_proj\.weight", 0)},
}
_LAYER = {"target": re.compile(r"^backbone\.layers\.(\d+)\."),
          "drafter": re.compile(r"^layers\.(\d+)\."),
          "eagle3": re.compile(r"^layers\.(\d+)\.")}


@dataclass
class Plan:
    kind: str
    tensors: list[OutTensor]              # sorted by name
    modules: dict[str, str]               # linear module prefix -> layout
    dropped: int                          # source tensors not carried over
    media: list[OutTensor] = field(default_factory=list)   # an Omni wrapper's, as exported


def load_source_tensors(src: Path) -> dict[str, TensorInfo]:
    """All tensors of a single-file or sharded (index.json) export, validated."""
    index_path = src / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _weight_map(index_path)
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors") if not p.name.startswith("."))
        weight_map = None
        if not files:
            raise ConversionError(f"{src}: missing file: no *.safetensors (and no index)")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise ConversionError(f"{index_path}: bad shard name {name!r}")
        for t in read_header(src / name).values():
            if t.name in tensors:
                raise ConversionError(
                    f"{src / name}: tensor {t.name!r} also in {tensors[t.name].file.name}")
            if weight_map is not None and weight_map.get(t.name) != name:
                raise ConversionError(
                    f"{src / name}: tensor {t.name!r} is not mapped to this file by "
                    f"{index_path.name}")
            tensors[t.name] = t
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ConversionError(
                f"{src / weight_map[missing[0]]}: tensor {missing[0]!r} listed in "
                f"{index_path.name} is missing")
    return tensors


def _weight_map(path: Path) -> dict[str, str]:
    with open_regular(path) as f:
        raw = f.read()
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ConversionError(f"{path}: corrupt index ({why})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{path}: corrupt index (no weight_map object)")
    bad = [v for v in weight_map.values() if not isinstance(v, str)]
    if bad:
        raise ConversionError(f"{path}: corrupt index (weight_map value {bad[0]!r} is not a "
                              f"file name)")
    return weight_map


def detect_kind(config: dict, names, config_path: Path) -> str:
    arch = config.get("architectures") or []
    if not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise ConversionError(f"{config_path}: architectures must be a list of strings, "
                              f"got {arch!r}")
    if set(arch) & set(DRAFTER_ARCHITECTURES) or (
            "fc.weight" in names and any(n.startswith("markov_head.") for n in names)):
        return DRAFTER
    if set(arch) & set(EAGLE3_ARCHITECTURES) or ("d2t" in names and "fc.weight" in names):
        return EAGLE3
    if any("NemotronH" in a for a in arch) or any(n.startswith("backbone.") for n in names):
        return TARGET
    raise ConversionError(
        f"{config_path}: unsupported model (architectures {arch}): expected a Nemotron-H "
        f"target, an NVIDIA DSpark or DFlash drafter or an EAGLE-3 head")


def _err(t: TensorInfo, msg: str) -> ConversionError:
    return ConversionError(f"{t.file}: tensor {t.name!r}: {msg}")


def _scalar_f32(t: TensorInfo, what: str) -> None:
    """A float32 scalar scale that is finite and positive (NaN, Inf, 0 or a negative scale
    would convert fine and generate garbage)."""
    if t.dtype != "F32" or t.numel != 1 or len(t.shape) > 1:
        raise _err(t, f"{what} must be a float32 scalar, got {t.dtype} {list(t.shape)}")
    with open_regular(t.file) as f:
        (value,) = struct.unpack("<f", next(read_chunks(f, t.start, 4))[1])
    if not (math.isfinite(value) and value > 0):
        raise _err(t, f"{what} is {value}: a scale must be finite and positive")


def _block_scales_valid(t: TensorInfo) -> None:
    with open_regular(t.file) as f:
        for pos, view in read_chunks(f, t.start, t.nbytes):
            chunk = bytes(view)
            if chunk.translate(None, _E4M3_OK):          # C speed; the search is the rare path
                i = re.search(rb"[^\x00-\x7e]", chunk).start()
                raise _err(t, f"block scale byte {pos - t.start + i} is 0x{chunk[i]:02X} (NaN "
                              f"or negative E4M3): a scale must be finite and non-negative")


def _index(t: TensorInfo, digits: str, what: str, limit) -> int:
    """A layer or expert number from a tensor name, checked against the config's count
    before anything is sized by it."""
    if len(digits) > MAX_INDEX_DIGITS or (len(digits) > 1 and digits[0] == "0"):
        raise _err(t, f"{what} index {digits[:12]!r} is not a plain number below 10^9")
    i = int(digits)
    if type(limit) is int and i >= limit:
        raise _err(t, f"{what} index {i} but config.json says there are {limit}")
    return i


def check_config_sizes(config: dict, tensors: dict[str, TensorInfo], kind: str,
                       config_path: Path) -> None:
    """The sizes config.json states must be the sizes of the tensors: the runtime allocates
    from the config, so a contradiction (hidden_size 10^12) is refused here."""
    for key in [*SIZE_CHECKS[kind], "n_routed_experts", "num_hidden_layers"]:
        want = config.get(key)
        if want is not None and (type(want) is not int or want <= 0):
            raise ConversionError(f"{config_path}: {key} must be a positive integer, "
                                  f"got {want!r}")
    for key, (pattern, axis) in SIZE_CHECKS[kind].items():
        want = config.get(key)
        if want is None:
            continue
        for name, t in tensors.items():
            if re.fullmatch(pattern, name) and t.shape[axis:axis + 1] != (want,):
                raise ConversionError(f"{config_path}: {key} {want} contradicts tensor "
                                      f"{name!r} of shape {list(t.shape)} in {t.file.name}")
    types = config.get("layers_block_type", config.get("hybrid_override_pattern"))
    layers = config.get("num_hidden_layers",
                        len(types) if isinstance(types, (list, str)) else None)
    for name, t in tensors.items():
        m = _LAYER[kind].match(name)
        if m:
            _index(t, m[1], "layer", layers)


def _module_tensors(prefix: str, src: dict[str, TensorInfo]) -> tuple[str, list[tuple]]:
    """The layout of the linear module at ``prefix`` and its output tensors as
    (name, dtype, shape, source) -- after checking every dtype and shape."""
    w = src[f"{prefix}.weight"]
    scale = src.get(f"{prefix}.weight_scale")
    scale2 = src.get(f"{prefix}.weight_scale_2")
    if w.dtype == "U8":
        if scale is None:
            raise _err(w, f"NVFP4 weight without its block scale {prefix}.weight_scale")
        if scale2 is None:
            raise _err(w, f"NVFP4 weight without its tensor scale {prefix}.weight_scale_2")
        if len(w.shape) != 2:
            raise _err(w, f"NVFP4 weight must be 2-D (out, in/2), got {list(w.shape)}")
        out, in_ = w.shape[0], 2 * w.shape[1]
        if in_ % GROUP_SIZE:
            raise _err(w, f"in_features {in_} is not a multiple of {GROUP_SIZE}: "
                          f"NVFP4 blocks cannot be carried over")
        if scale.dtype != "F8_E4M3":
            raise _err(scale, f"block scale must be F8_E4M3, got {scale.dtype}")
        if len(scale.shape) != 2:
            raise _err(scale, f"block scale has shape {list(scale.shape)}: swizzled (1-D) scales "
                              f"are refused, expected row-major {[out, in_ // GROUP_SIZE]}")
        if scale.shape != (out, in_ // GROUP_SIZE):
            padded = scale.shape[0] != out and scale.shape[0] % 128 == 0
            raise _err(scale, f"block scale shape {list(scale.shape)} != "
                              f"{[out, in_ // GROUP_SIZE]}"
                              + (" (rows padded to 128: swizzled layout refused)" if padded else ""))
        _scalar_f32(scale2, "tensor scale weight_scale_2")
        _block_scales_valid(scale)
        return "nvfp4", [
            (f"{prefix}.weight", "U32", (out, in_ // 8), w),
            (f"{prefix}.scales", "U8", scale.shape, scale),
            (f"{prefix}.weight_scale_2", "F32", (), scale2),
        ]
    if w.dtype == "F8_E4M3":
        if scale is None:
            raise _err(w, f"FP8 weight without its scale {prefix}.weight_scale")
        if scale2 is not None:
            raise _err(scale2, "weight_scale_2 on an FP8 weight (not a ModelOpt FP8 layout)")
        if len(w.shape) != 2:
            raise _err(w, f"FP8 weight must be 2-D, got {list(w.shape)}")
        if scale.numel != 1:
            raise _err(scale, f"FP8 scale of shape {list(scale.shape)}: only per-tensor FP8 "
                              f"is supported")
        _scalar_f32(scale, "FP8 weight_scale")
        return "fp8", [
            (f"{prefix}.weight", "U8", w.shape, w),
            (f"{prefix}.weight_scale", "F32", (), scale),
        ]
    if w.dtype in DENSE_DTYPES:
        if scale is not None or scale2 is not None:
            raise _err(w, f"dtype {w.dtype} but the module has quantization scales: expected "
                          f"U8 (NVFP4) or F8_E4M3 (FP8)")
        return DENSE_DTYPES[w.dtype], [(w.name, w.dtype, w.shape, w)]
    raise _err(w, f"unsupported weight dtype {w.dtype}")


def build_plan(src: Path, config: dict, spec: QuantSpec, *, keep_mtp: bool) -> Plan:
    config_path = src / "config.json"
    tensors = load_source_tensors(src)
    media = {}
    if config.get(WRAPPER):          # an Omni wrapper: its text tower, under the plain names
        media = {n: t for n, t in tensors.items() if tower_name(n) is None}
        tensors = {tower_name(n): replace(t, name=tower_name(n)) for n, t in tensors.items()
                   if n not in media}
    kind = detect_kind(config, tensors, config_path)
    refusal = speculators_refusal(config, config_path) if kind == DRAFTER else None
    if refusal:
        raise ConversionError(refusal)
    if kind == DRAFTER and tensors and all(n.startswith("model.") for n in tensors):
        # NVIDIA's drafter names have no "model." prefix; some exports wrap the tree in one.
        tensors = {n[6:]: replace(t, name=n[6:]) for n, t in tensors.items()}
    check_config_sizes(config, tensors, kind, config_path)
    latent = latent_problem(config, {n: t.shape for n, t in tensors.items()}, config_path) \
        if kind == TARGET else None
    if latent:
        raise ConversionError(latent)

    for name, t in tensors.items():
        if _EXTRAS.search(name):
            raise _err(t, "AWQ/SVDQuant extra tensor: the weights are only valid together with "
                          "it, which MLX's nvfp4 layout cannot express")
    dropped = 0
    keep = {}
    for name, t in tensors.items():
        if name.endswith(DROPPED_SUFFIXES) or (kind == TARGET and not keep_mtp
                                              and name.startswith("mtp.")):
            dropped += 1
        else:
            keep[name] = t

    modules: dict[str, str] = {}
    items: list[tuple] = []
    claimed: set[str] = set()
    for name in sorted(keep):
        t = keep[name]
        if not name.endswith(".weight") or (len(t.shape) < 2 and t.dtype in DENSE_DTYPES):
            continue                                  # norms and other vectors: copied below
        prefix = name[:-len(".weight")]
        fmt, outs = _module_tensors(prefix, keep)
        expected = spec.expected(prefix)
        quantized = fmt in ("nvfp4", "fp8")
        if quantized and expected != fmt or not quantized and expected and spec.explicit:
            raise _err(t, f"tensors are {fmt} but {spec.source} says "
                          f"{expected or 'unquantized'} for module {prefix!r}")
        if len(t.shape) == 2 and not _EMBEDDINGS.search(prefix):
            modules[prefix] = fmt
        claimed.update(o[3].name for o in outs)
        items.extend(outs)
    for name in sorted(set(keep) - claimed):
        t = keep[name]
        if name.endswith((".weight_scale", ".weight_scale_2")):
            raise _err(t, f"scale without its weight {name.rsplit('.', 1)[0]}.weight")
        if t.dtype not in DENSE_DTYPES and t.dtype not in ("I64", "I32", "BOOL"):
            raise _err(t, f"unsupported dtype {t.dtype} for an unquantized tensor")
        items.append((name, t.dtype, t.shape, t))

    if spec.explicit:
        # every dotted prefix of every tensor name: one set lookup per listed layer
        parts = [n.split(".") for n in [*tensors, *media]]
        present = {".".join(p[:i]) for p in parts for i in range(1, len(p))}
        for layer in spec.layers:
            if layer not in present:
                raise ConversionError(f"{src / spec.source}: quantized_layers names {layer!r} "
                                      f"but no such module has tensors")

    out = _stack_experts(items, config.get("n_routed_experts")) if kind == TARGET else [
        OutTensor(n, d, tuple(s), (t,)) for n, d, s, t in items]
    out.sort(key=lambda o: o.name)
    return Plan(kind, out, _stack_module_names(modules), dropped,
                [OutTensor(n, t.dtype, tuple(t.shape), (t,)) for n, t in sorted(media.items())])


def _stack_experts(items: list[tuple], n_experts) -> list[OutTensor]:
    """``X.experts.{e}.R`` for e = 0..E-1 -> ``X.experts.R`` with a leading E axis; E must be
    config.json's ``n_routed_experts`` when it names one."""
    out, groups = [], defaultdict(dict)
    for name, dtype, shape, src in items:
        m = _EXPERT.match(name)
        if m is None:
            out.append(OutTensor(name, dtype, tuple(shape), (src,)))
        else:
            e = _index(src, m[2], "expert", n_experts)
            groups[(m[1], m[3])][e] = (dtype, tuple(shape), src)
    index_sets = defaultdict(set)
    for (base, rest), members in sorted(groups.items()):
        idx = sorted(members)
        count = n_experts if type(n_experts) is int else len(idx)
        if len(idx) != count or idx[-1] != count - 1:      # sorted, distinct: 0..count-1
            missing = list(islice((e for e in range(count) if e not in members), 5))
            first = members[idx[0]][2]
            raise _err(first, f"experts of {base}.*.{rest} are not numbered 0..E-1 "
                              f"(missing {missing})")
        index_sets[base].add(len(idx))
        if len(index_sets[base]) > 1:
            raise _err(members[0][2], f"{base}: projections have different expert counts or "
                                      f"layouts across experts")
        dtype, shape, _ = members[0]
        for e in idx:
            d, s, src = members[e]
            if (d, s) != (dtype, shape):
                raise _err(src, f"expert {e} has {d} {list(s)}, expert 0 has {dtype} "
                                f"{list(shape)}: cannot stack")
        out.append(OutTensor(f"{base}.{rest}", dtype, (len(idx),) + shape,
                             tuple(members[e][2] for e in idx)))
    return out


def _stack_module_names(modules: dict[str, str]) -> dict[str, str]:
    """Experts appear once, under their stacked prefix (their layouts were checked equal
    when the tensors were stacked)."""
    stacked = {}
    for prefix, fmt in modules.items():
        m = _EXPERT.match(prefix)
        stacked[f"{m[1]}.{m[3]}" if m else prefix] = fmt
    return dict(sorted(stacked.items()))
