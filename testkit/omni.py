"""Nemotron Omni / VL wrapper directories built around any target directory, the way NVIDIA's
parent holds Lightning's text tower (converter/omni.py): the tower's config under
``llm_config`` (or ``text_config``), its tensors under ``language_model.``, random vision,
projector and audio tensors beside them. A ModelOpt export wraps as ModelOpt exports the
parent: quantization at the top level, module names in it prefixed (NumPy only). With the
``omni`` extra, :func:`tiny_omni` builds a whole random Omni with mlx-vlm's model class, and
the media helpers below make images, audio and the parts that carry them."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import wave
import zlib
from pathlib import Path

import numpy as np

from testkit.codecs import bf16_bytes, read_raw_safetensors, write_raw_safetensors

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


# ------------------------------------------------------------------ with the omni extra

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<image>",
            "<img>", "</img>", "<so_embedding>", "<so_start>", "<so_end>", "<video>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer(out: Path) -> int:
    """A character-level tokenizer with the Omni placeholders as special tokens and a chat
    template, written to ``out``; returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(vocab)


def tiny_omni_config(vocab: int) -> dict:
    """An Omni parent's config.json at toy size (RADIO and Parakeet towers of one block)."""
    from testkit.toy import tiny_config

    text = tiny_config("M*EME", vocab_size=vocab, num_hidden_layers=5,
                       architectures=["NemotronHForCausalLM"], time_step_limit=[0.0, 1e9])
    return {
        "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "model_type": "NemotronH_Nano_Omni_Reasoning_V3", "llm_config": text,
        "vision_config": {"model_type": "radio", "hidden_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 16,
                          "image_size": 64, "max_resolution": 128,
                          "args": {"register_multiple": 4}},
        "sound_config": {"model_type": "parakeet", "hidden_size": 32, "num_attention_heads": 2,
                         "num_hidden_layers": 1, "intermediate_size": 64,
                         "subsampling_conv_channels": 8, "num_mel_bins": 16,
                         "projection_hidden_size": 48, "conv_kernel_size": 3},
        "downsample_ratio": 0.5, "ps_version": "v2", "projector_hidden_size": 48,
        "vit_hidden_size": 32, "img_context_token_id": SPECIALS.index("<image>"),
        "sound_context_token_id": SPECIALS.index("<so_embedding>"),
        "video_context_token_id": SPECIALS.index("<video>"),
        "eos_token_id": SPECIALS.index("</s>")}


PREPROCESSOR = {"norm_mean": [0.48, 0.46, 0.41], "norm_std": [0.27, 0.26, 0.28],
                "patch_size": 16, "downsample_ratio": 0.5, "min_num_patches": 4,
                "max_num_patches": 64, "max_model_len": 4096}


def hf_names(model) -> dict:
    """mlx-vlm's Omni parameters under the parent's Hugging Face names (inverse of its
    ``sanitize``): the text tower as testkit.toy writes it, the projector as
    ``mlp1.{0,1,3}``, the audio convolutions in PyTorch's layout beside a feature-extractor
    buffer (which is how mlx-vlm tells that layout)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from testkit.toy import hf_weights_from_mlx_lm

    out = {f"language_model.{k}": v
           for k, v in hf_weights_from_mlx_lm(model.language_model).items()}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("language_model."):
            continue
        if k.startswith("mlp1.layers."):
            k = "mlp1." + k[len("mlp1.layers."):]
        elif k.startswith("sound_encoder.encoder.") and k.endswith(".weight") and v.ndim == 3:
            v = v.transpose(0, 2, 1)
        elif k.startswith("sound_encoder.encoder.") and k.endswith(".weight") and v.ndim == 4:
            v = v.transpose(0, 3, 1, 2)
        out[k] = v
    out["sound_encoder.encoder.feature_extractor.featurizer.window"] = mx.ones((16,))
    return out


def tiny_omni(out, seed: int = 0):
    """A tiny random Nano Omni checkpoint made with mlx-vlm's own model class (every
    parameter drawn at random) and saved in the Hugging Face layout (float32 weights, the
    tokenizer, the image processor's config); returns ``(out, the mlx-vlm model)``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.nemotron_h_nano_omni import Model, ModelConfig

    out = Path(out)
    out.mkdir(parents=True)
    config = tiny_omni_config(tiny_tokenizer(out))
    model = Model(ModelConfig.from_dict(json.loads(json.dumps(config))))
    mx.random.seed(seed)
    params = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log"):
            v = mx.log(mx.random.uniform(1.0, 16.0, v.shape))
        elif k.endswith(("running_var", "norm.weight", "norm_f.weight")) or ".norm" in k \
                and k.endswith(".weight"):
            v = 1.0 + 0.1 * mx.random.normal(v.shape)
        elif k.endswith("running_mean") or v.ndim < 2:
            v = 0.1 * mx.random.normal(v.shape)
        else:
            v = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        params.append((k, v))
    model.load_weights(params)
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), hf_names(model),
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return out, model


# ------------------------------------------------------------ media for tests and benchmarks

def png(w=100, h=70, seed=0) -> bytes:
    """A random RGB PNG."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header declares ``w`` x ``h`` pixels (and holds almost none)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def wav(seconds: float, rate=16000, seed=0) -> bytes:
    """Random 16-bit mono WAV."""
    samples = (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 3000)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def audio_part(data: bytes, fmt="wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


def vlm_inputs(pair, text: str, images=(), audio=()):
    """mlx-vlm's processor on ``text`` (placeholders as its chat template writes them) and the
    media bytes: its prompt ids and its inputs (pixel values, sound clips)."""
    from PIL import Image

    from mlx_dspark.media import parts
    proc = pair.tokenizer.media.processor
    inputs = proc(text=text, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images]
                  or None, audio=[parts.decode(parts.Media("audio", a, "x", "wav")).decoded
                                  for a in audio] or None)
    return [int(t) for t in np.array(inputs["input_ids"][0])], inputs
