"""Whether a checkpoint is already in an MLX layout, from its config and tensor names alone:
mlx-dspark's own (``quantization.layout``), or mlx-lm's (what ``mlx_lm.convert`` writes: MLX
quantization described under ``quantization``, or float weights with stacked
``mixer.switch_mlp`` experts). ``convert`` says such an input loads as it is instead of
converting it; the runtime's reading of every format (checkpoint/formats.py) starts here."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import LAYOUT

MLX_LM_EXPERTS = ".switch_mlp."
"""The name part of mlx-lm's stacked experts (``mixer.switch_mlp.fc1`` / ``fc2``)."""

NAMES = {"mlx-dspark": "mlx-dspark's converted layout", "mlx-lm": "mlx-lm's layout",
         "hf": "Hugging Face layout", "modelopt": "a ModelOpt export"}


@dataclass(frozen=True)
class Format:
    layout: str          # "mlx-dspark", "mlx-lm", "hf" or "modelopt"
    precision: str       # "bf16", "affine 4-bit (group 64)", "nvfp4", "NVFP4 (ModelOpt)", ...

    def __str__(self) -> str:
        return f"{NAMES[self.layout]}, {self.precision}"


def mlx_lm_precision(q: dict) -> str:
    """``quantization`` as mlx-lm writes it: defaults plus per-module overrides (a dict, or
    False for a module left in float)."""
    def scheme(d):
        mode, bits, group = d.get("mode", "affine"), d.get("bits"), d.get("group_size")
        return f"affine {bits}-bit (group {group})" if mode == "affine" else str(mode)

    over = sorted({scheme(v) for v in q.values() if isinstance(v, dict)} - {scheme(q)})
    return scheme(q) + (f", per-module {' and '.join(over)}" if over else "")


def dense_precision(config: dict, tensors: dict) -> str:
    """The float dtype most weights have (float32 routers and A_log aside), or, where only
    names are known (a repo's index), the config's word for it."""
    floats = [d for n, d in tensors.items() if n.endswith(".weight") and d in _WORDS]
    if floats:
        return _WORDS[max(sorted(set(floats)), key=floats.count)]
    word = str(config.get("torch_dtype") or config.get("dtype") or "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(word, "float")


_WORDS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def mlx_layout(config: dict, tensors: dict) -> Format | None:
    """The MLX layout a checkpoint is in (``tensors``: name -> safetensors dtype, or None where
    only names are known), or None when it is in none."""
    quant = config.get("quantization")
    if isinstance(quant, dict) and quant.get("layout") == LAYOUT:
        return Format("mlx-dspark", str(quant.get("source_quant_algo") or "bf16"))
    if isinstance(quant, dict):
        return Format("mlx-lm", mlx_lm_precision(quant))
    if any(MLX_LM_EXPERTS in n for n in tensors):
        return Format("mlx-lm", dense_precision(config, tensors))
    return None
