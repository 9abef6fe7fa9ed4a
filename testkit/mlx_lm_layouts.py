"""Checkpoints in mlx-lm's Nemotron-H layout, made the way an mlx-lm user makes them: a dense
Hugging Face directory (the demo target's weights, dequantized exactly) put through mlx-lm's
own ``mlx_lm.convert``, at every precision it writes (``FORMATS``).

``python -m testkit.mlx_lm_layouts OUT`` writes the dense source and every format
under OUT (what docs/formats.md's table was measured on)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from mlx_dspark.open_files import import_mlx_lm

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")

FORMATS = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "fp32": dict(dtype="float32"),
    **{f"affine-{b}bit": dict(quantize=True, q_bits=b, q_group_size=64, dtype="bfloat16")
       for b in (2, 3, 4, 5, 6, 8)},
    "affine-4bit-g32": dict(quantize=True, q_bits=4, q_group_size=32, dtype="bfloat16"),
    "mixed-3-6": dict(quantize=True, q_group_size=64, quant_predicate="mixed_3_6",
                      dtype="bfloat16"),
    "mxfp4": dict(quantize=True, q_mode="mxfp4", dtype="bfloat16"),
    "nvfp4": dict(quantize=True, q_mode="nvfp4", dtype="bfloat16"),
    "mxfp8": dict(quantize=True, q_mode="mxfp8", dtype="bfloat16"),
}
"""name -> ``mlx_lm.convert`` keywords: float copies with stacked ``switch_mlp`` experts, MLX
affine quantization at each bit width (plus a smaller group and mlx-lm's mixed 3/6-bit recipe,
which writes per-layer overrides), and MLX's ``mxfp4``, ``nvfp4`` and ``mxfp8`` modes."""


def _dense(tensors: dict, name: str, dtype) -> mx.array:
    """The float value of the converted module under ``name`` (``P.weight``): NVFP4 codes times
    block scales times the tensor scale, FP8 times its scale, in float32 (exact), then ``dtype``."""
    p = name[:-len(".weight")]
    w = tensors[name]
    if f"{p}.scales" in tensors:
        ws2 = tensors[f"{p}.weight_scale_2"].astype(mx.float32)
        w = mx.dequantize(w, tensors[f"{p}.scales"], group_size=16, bits=4, mode="nvfp4",
                          dtype=mx.float32) * ws2.reshape(*ws2.shape, 1, 1)
    elif f"{p}.weight_scale" in tensors:
        scale = tensors[f"{p}.weight_scale"].astype(mx.float32)
        w = mx.from_fp8(w, dtype=mx.float32) * scale.reshape(*scale.shape, 1, 1)
    return w.astype(dtype)


def dense_hf(converted: str | Path, out: str | Path, dtype=mx.float32, mtp: bool = True) -> Path:
    """A converted (``mlx-dspark/1``) target as a plain Hugging Face directory: every module
    dense in ``dtype`` (router weights and correction biases float32, as NVIDIA ships them),
    experts one tensor set per expert, the MTP block kept unless ``mtp`` is False, config
    without quantization, tokenizer files copied."""
    converted, out = Path(converted), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(converted.glob("model*.safetensors")):
        tensors.update(mx.load(str(f)))
    dense = {}
    for name, v in tensors.items():
        if name.endswith((".scales", ".weight_scale_2", ".weight_scale")):
            continue
        if name.startswith("mtp.") and not mtp:
            continue
        keep = mx.float32 if ".gate." in name else dtype
        v = _dense(tensors, name, keep) if name.endswith(".weight") else v.astype(keep)
        if ".experts." in name and v.ndim == 3:
            base, proj = name.split(".experts.")
            for e in range(v.shape[0]):
                dense[f"{base}.experts.{e}.{proj}"] = v[e]
        else:
            dense[name] = v
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "pt"})
    config = json.loads((converted / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["dtype"] = str(dtype).rsplit(".", 1)[-1]
    if not mtp:
        config["num_nextn_predict_layers"] = 0
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (converted / name).is_file():
            shutil.copy(converted / name, out / name)
    return out


def with_config(src: str | Path, dst: str | Path, **fields) -> Path:
    """A copy of the model directory ``src`` at ``dst`` with ``fields`` set in its config.json
    (a config that contradicts the files, for the refusals' tests)."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def mlx_lm_greedy(model, ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` from mlx-lm's model, with its own cache."""
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def mlx_lm_convert(src: str | Path, out: str | Path, **options) -> Path:
    """``mlx_lm.convert(src, out, **options)`` with its progress prints kept off stdout."""
    convert = import_mlx_lm("mlx_lm.convert").convert
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(out), **options)
    return Path(out)


def make_all(out: str | Path, source: str | Path, formats=None) -> dict:
    """The dense source of ``source`` (a converted target) under ``out/hf-fp32``, then each of
    ``formats`` (default: all of :data:`FORMATS`) converted from it by mlx-lm; name -> path."""
    out = Path(out)
    hf = dense_hf(source, out / "hf-fp32")
    made = {"hf-fp32": hf}
    for name in formats or FORMATS:
        made[name] = mlx_lm_convert(hf, out / name, **FORMATS[name])
    return made


if __name__ == "__main__":
    from mlx_dspark.api import DEMO
    for name, path in make_all(sys.argv[1], DEMO / "target").items():
        print(name, path)
