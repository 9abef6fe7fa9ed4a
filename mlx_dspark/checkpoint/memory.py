"""Memory pre-flight: what a pair will need once loaded, against what the device can give,
checked from the checkpoint headers before a byte of weights is read.

Needed: every tensor at the size the loader gives it (packed NVFP4 and the embedding table
stay as stored; FP8 weights are decoded and float tensors cast to the compute dtype, never
below their stored width), plus the caches for ``context`` tokens, plus the largest single
tensor (the loader converts one tensor at a time, target._materialize). Available: on Apple
GPUs MLX's recommended working-set size (unified memory beyond it pages or fails), elsewhere
the memory the OS reports available now."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from ..converter.layout import mtp_pattern
from ..converter.omni import renamer, text_config, wrapper_name
from ..device import accumulation_dtype, on_gpu
from .integrity import checkpoint_files

GB = 1e9
DEFAULT_CONTEXT = 8192
"""Tokens of context the caches are sized for when the caller does not say."""

_KEEP_STORED = ("backbone.embeddings.weight", "embed_tokens.weight")


class InsufficientMemory(ValueError):
    """The pair will not fit: the message says what is needed, what there is, what to do."""


def available_memory() -> tuple[int, str]:
    """(bytes, where they come from)."""
    if on_gpu():
        info = mx.device_info()
        if "max_recommended_working_set_size" in info:       # Apple GPUs
            return int(info["max_recommended_working_set_size"]), \
                "the GPU's recommended working set"
        if "memory_size" in info:
            return int(info["memory_size"]), "the GPU's memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM"


def weight_bytes(path, dtype, mtp: bool = False) -> tuple[int, int]:
    """(bytes the loaded tensors of a converted directory take in ``dtype``, the largest
    original that a conversion briefly holds beside its converted copy). A target's native
    MTP block (``mtp.*``) is read only as a drafter: counted only with ``mtp``."""
    from ..converter.safetensors_io import ITEMSIZE, read_header

    compute = mx.finfo(dtype).bits // 8
    decoded = mx.finfo(accumulation_dtype(dtype)).bits // 8     # FP8 in a float16 model: fp32
    infos, rename = {}, renamer(path)
    for f in checkpoint_files(path):      # what the load will read; the path is no pattern
        infos.update({rename(n): t for n, t in read_header(Path(f)).items()
                      if rename(n) is not None})        # an Omni wrapper's media: not read
    total = largest = 0
    for name, t in infos.items():
        if name.startswith("mtp.") and not mtp:
            continue
        stored = ITEMSIZE[t.dtype]        # read_header refuses dtypes it does not know
        if name.endswith(_KEEP_STORED) or t.dtype in ("U32", "I32", "U64", "I64"):
            size = stored                              # packed NVFP4, embedding tables
        elif t.dtype == "U8":                          # FP8 weights are decoded at load
            fp8 = name.endswith(".weight") and f"{name[:-7]}.weight_scale" in infos
            size = decoded if fp8 else stored
        else:
            size = max(stored, compute)
        total += t.numel * size
        if size != stored:                             # its original lives until converted
            largest = max(largest, t.nbytes)
    return total, largest


def cache_bytes(config: dict, context: int, dtype) -> int:
    """Target caches for ``context`` tokens: attention K/V in ``dtype``, Mamba conv window
    and SSM state in float32 (their size does not grow with the context)."""
    pattern = config.get("hybrid_override_pattern") or ""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config.get("num_key_value_heads", 8) * hd * context * (mx.finfo(dtype).bits // 8)
    h, p = config.get("mamba_num_heads", 128), config.get("mamba_head_dim", 64)
    n, g = config.get("ssm_state_size", 128), config.get("n_groups", 8)
    mamba = 4 * (h * p * n + (config.get("conv_kernel", 4) - 1) * (h * p + 2 * g * n))
    return pattern.count("*") * kv + pattern.count("M") * mamba


def drafter_cache_bytes(config: dict, context: int, dtype) -> int:
    window = min(context, config.get("sliding_window") or context)
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * hd * window
            * (mx.finfo(dtype).bits // 8))


def _config(path) -> dict:
    try:
        with open(os.path.join(str(path), "config.json")) as f:
            config = json.load(f)
        return text_config(config, path) if wrapper_name(config) else config
    except (OSError, ValueError, AttributeError):
        return {}     # the loader reports a missing or broken config with its own message


def needed_bytes(model, drafter=None, dtype=mx.float32, context: int = DEFAULT_CONTEXT
                 ) -> tuple[int, str]:
    """(bytes the pair needs, a short breakdown)."""
    weights, largest = weight_bytes(model, dtype)
    cfg = _config(model)
    caches = cache_bytes(cfg, context, dtype) if cfg.get("hybrid_override_pattern") else 0
    if drafter == "mtp":
        # The target's own MTP block: its weights, and K/V for its attention layers.
        dw, dl = weight_bytes(model, dtype, mtp=True)
        weights, largest = dw, max(largest, dl)
        pattern = mtp_pattern(cfg) if cfg.get("hybrid_override_pattern") else ""
        caches += cache_bytes({**cfg, "hybrid_override_pattern": pattern}, context, dtype)
    elif drafter is not None:
        dw, dl = weight_bytes(drafter, dtype)
        weights, largest = weights + dw, max(largest, dl)
        dcfg = _config(drafter)
        if "num_hidden_layers" in dcfg:
            caches += drafter_cache_bytes(dcfg, context, dtype)
    parts = (f"{weights / GB:.1f} GB weights in {str(dtype).split('.')[-1]}, "
             f"{caches / GB:.1f} GB caches for {context} tokens, "
             f"{largest / GB:.1f} GB while converting the largest tensor")
    return weights + caches + largest, parts


def check_fits(model, drafter=None, dtype=mx.float32, context: int = DEFAULT_CONTEXT) -> None:
    """Raise :class:`InsufficientMemory` when the pair will not fit the device."""
    from ..converter.errors import ConversionError
    try:
        need, parts = needed_bytes(model, drafter, dtype, context)
    except (ConversionError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return      # unreadable headers or config: the loader names the file and the problem
    have, where = available_memory()
    if need <= have:
        return
    hint = ""
    if mx.finfo(dtype).bits > 16 and needed_bytes(model, drafter, mx.bfloat16, context)[0] <= have:
        hint = "use dtype bfloat16 (--dtype bfloat16), "
    raise InsufficientMemory(
        f"{model}: needs about {need / GB:.1f} GB ({parts}) but {where} is "
        f"{have / GB:.1f} GB; {hint}free memory, or use a smaller model; "
        f"memory_check=False (--no-memory-check) loads anyway")


def media_bytes(path, dtype) -> int:
    """Bytes an Omni parent's vision and audio towers take once media arrive (their tensors
    as stored, float ones at least ``dtype``'s width): what a text-only load leaves out."""
    from ..converter.safetensors_io import ITEMSIZE, read_header

    rename, total = renamer(path), 0
    compute = mx.finfo(dtype).bits // 8
    for f in sorted(Path(path).glob("*.safetensors")):
        if f.name.startswith(("model", "media")):
            total += sum(t.numel * (max(ITEMSIZE[t.dtype], compute) if t.dtype in
                                    ("BF16", "F16", "F32") else ITEMSIZE[t.dtype])
                         for n, t in read_header(f).items() if rename(n) is None)
    return total


def check_media_fits(path, dtype) -> None:
    """Raise :class:`InsufficientMemory` when the media towers will not fit beside what is
    already loaded (asked before their first use)."""
    need = media_bytes(path, dtype)
    have, where = available_memory()
    if need > have:
        raise InsufficientMemory(f"{path}: its vision and audio towers need about "
                                 f"{need / GB:.1f} GB but {where} is {have / GB:.1f} GB; "
                                 f"free memory, or send text only")


def check_download(nbytes: int, name: str) -> None:
    """Before a repo is downloaded: refuse one whose weights alone (its safetensors index's
    total size) exceed what the device can give."""
    have, where = available_memory()
    if nbytes > have:
        raise InsufficientMemory(
            f"{name}: its weights alone are {nbytes / GB:.1f} GB (its safetensors index) but "
            f"{where} is {have / GB:.1f} GB, so nothing was downloaded; use a smaller "
            f"quantization, or memory_check=False (--no-memory-check) to download it anyway")
