"""Nemotron Omni / VL wrapper directories built around any target directory, the way NVIDIA's
parent holds Lightning's text tower (converter/omni.py): the tower's config under
``llm_config`` (or ``text_config``), its tensors under ``language_model.``, random vision,
projector and audio tensors beside them. A ModelOpt export wraps as ModelOpt exports the
parent: quantization at the top level, module names in it prefixed. NumPy only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .codecs import bf16_bytes, read_raw_safetensors, write_raw_safetensors

MEDIA = {"vision_model.radio_model.model.patch_generator.embedder.weight": (64, 48),
         "vision_model.radio_model.model.blocks.0.mlp.fc1.weight": (128, 64),
         "mlp1.0.weight": (256,), "mlp1.1.weight": (96, 256), "mlp1.3.weight": (96, 96),
         "sound_encoder.encoder.layers.0.feed_forward1.linear1.weight": (128, 64)}
"""Media tensor names as the parent's checkpoint spells them (shapes are a toy's)."""
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json", "special_tokens_map.json")


def _prefixed(quant: dict) -> dict:
    """A ModelOpt quantization description with the tower's module names prefixed and the
    media towers excluded, as an export of the whole parent names them."""
    quant = dict(quant)
    for key in ("exclude_modules", "ignore"):
        if isinstance(quant.get(key), list):
            quant[key] = [f"language_model.{p}" for p in quant[key]] + [
                "vision_model*", "mlp1*", "sound_encoder*"]
    if isinstance(quant.get("quantized_layers"), dict):
        quant["quantized_layers"] = {f"language_model.{k}": v
                                     for k, v in quant["quantized_layers"].items()}
    return quant


def wrap(src, out, spelling: str = "NemotronH_Nano_VL_V2", key: str = "llm_config",
         media: dict | None = None, seed: int = 0) -> Path:
    """``src`` (a target directory: Hugging Face, ModelOpt export) wrapped as an Omni parent
    at ``out``. ``media``: name -> shape of the media tensors (BF16 random), default
    :data:`MEDIA`; they join a single file, or get a shard of their own beside several."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config", None)
    wrapper = {"architectures": [spelling], "model_type": spelling, key: config,
               "vision_config": {"model_type": "radio", "hidden_size": 64},
               "sound_config": {"model_type": "parakeet", "hidden_size": 64},
               "img_context_token_id": 18, "sound_context_token_id": 27,
               "downsample_ratio": 0.5, "projector_hidden_size": 96, "vit_hidden_size": 64,
               "ps_version": "v2"}
    if quant is not None:
        wrapper["quantization_config"] = _prefixed(quant)
    (out / "config.json").write_text(json.dumps(wrapper, indent=2))
    shards = {f.name: {f"language_model.{n}": t for n, t in read_raw_safetensors(f).items()}
              for f in sorted(src.glob("model*.safetensors"))}
    media_tensors = {n: ("BF16", s, bf16_bytes(rng.standard_normal(s).astype(np.float32) * .02))
                     for n, s in (MEDIA if media is None else media).items()}
    if len(shards) == 1:             # one file: the media join it, as a small export has it
        next(iter(shards.values())).update(media_tensors)
    else:
        shards["model-media.safetensors"] = media_tensors
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, ts in shards.items() for n in ts}},
            indent=2))
    for f, tensors in shards.items():
        write_raw_safetensors(out / f, tensors, {"format": "pt"})
    hf_quant = src / "hf_quant_config.json"
    if hf_quant.is_file():
        doc = json.loads(hf_quant.read_text())
        doc["quantization"] = _prefixed(doc["quantization"])
        (out / "hf_quant_config.json").write_text(json.dumps(doc, indent=2))
    for n in COPIED:
        if (src / n).is_file():
            shutil.copy(src / n, out / n)
    return out
