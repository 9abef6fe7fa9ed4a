"""Synthetic checkpoints in ModelOpt's Hugging Face export layout, built with NumPy only.

Independent of the converter on purpose: its own NVFP4/FP8 quantizer (E2M1 codes, E4M3 block
scales, per-tensor ``weight_scale_2 = amax / (6·448)``, two codes per byte, even element in
the low nibble), its own E4M3 codec, its own raw safetensors writer and reader. Real ModelOpt
exports (tests/fixtures/modelopt/) are the other oracle; these cover what they cannot: every
algorithm, sharding, quirks and deliberately broken inputs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E4M3_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """float32 value of every E4M3 byte (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    val = np.where((b & 0x7F) == 0x7F, np.nan, sign * val)
    return val.astype(np.float32)


E4M3 = e4m3_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Round to the nearest E4M3 value (ties to the even code), saturating at 448."""
    x = np.asarray(x, np.float64)
    mags = E4M3[:127].astype(np.float64)                  # codes 0..126, increasing
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(mags, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    return (code | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def bf16_bytes(x: np.ndarray) -> bytes:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def nvfp4_quantize(w: np.ndarray):
    """ModelOpt-style NVFP4: returns (packed uint8 (out, in/2), E4M3 scale bytes (out, in/16),
    float32 weight_scale_2)."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    ws2 = np.float32(np.abs(w).max() / (6 * E4M3_MAX))
    blocks = w.reshape(out, n // 16, 16)
    scale = e4m3_encode(np.abs(blocks).max(-1) / (6 * ws2))
    denom = (E4M3[scale] * ws2)[..., None]
    scaled = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom > 0)
    mag = np.abs(E2M1[:8])
    code = np.abs(np.abs(scaled)[..., None] - mag).argmin(-1)
    code = (code | np.where(np.signbit(scaled), 8, 0)).reshape(out, n).astype(np.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), scale, ws2


def nvfp4_dequantize(packed, scale, ws2) -> np.ndarray:
    """ModelOpt's formula: e2m1(code) · (float(block scale) · weight_scale_2), fp32."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    s = (E4M3[np.asarray(scale, np.uint8)] * np.float32(ws2)).astype(np.float32)
    return E2M1[codes] * np.repeat(s, 16, axis=-1)


def fp8_quantize(w: np.ndarray):
    w = np.asarray(w, np.float32)
    scale = np.float32(np.abs(w).max() / E4M3_MAX)
    return e4m3_encode(w / scale), scale


# ---------------------------------------------------------------- raw safetensors


def write_raw_safetensors(path: Path, tensors: dict, metadata=None) -> None:
    """``tensors``: name -> (dtype, shape, bytes), written in the dict's order."""
    header, off = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors.values():
            f.write(data)


def read_raw_safetensors(path: Path) -> dict:
    """name -> (dtype, shape, bytes) for every tensor of one file."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], tuple(v["shape"]), blob[base + v["data_offsets"][0]:
                                                    base + v["data_offsets"][1]])
            for k, v in header.items()}


def read_raw_checkpoint(src: Path) -> dict:
    out = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        out.update(read_raw_safetensors(f))
    return out


# ---------------------------------------------------------------- checkpoints

SENTINEL = "\u0000backbone.pt_name_sentinel"
H, V, E = 64, 128, 4                       # hidden, vocab, routed experts
TARGET_PATTERN = "MEM*E"
BLOCK_TYPE = {"M": "linear_attention", "E": "moe", "*": "full_attention"}


def _target_modules(pattern=TARGET_PATTERN):
    """prefix -> (out, in) of every linear module of the tiny Nemotron-H, and extra tensors."""
    lin, extra = {}, {}
    for i, c in enumerate(pattern):
        p = f"backbone.layers.{i}"
        extra[f"{p}.norm.weight"] = ("BF16", (H,))
        if c == "M":
            lin[f"{p}.mixer.in_proj"] = (196, H)
            lin[f"{p}.mixer.out_proj"] = (H, H)
            extra.update({f"{p}.mixer.conv1d.weight": ("BF16", (128, 1, 4)),
                          f"{p}.mixer.conv1d.bias": ("BF16", (128,)),
                          f"{p}.mixer.A_log": ("F32", (4,)), f"{p}.mixer.D": ("F32", (4,)),
                          f"{p}.mixer.dt_bias": ("BF16", (4,)),
                          f"{p}.mixer.norm.weight": ("BF16", (H,))})
        elif c == "E":
            for e in range(E):
                lin[f"{p}.mixer.experts.{e}.up_proj"] = (32, H)
                lin[f"{p}.mixer.experts.{e}.down_proj"] = (H, 32)
            lin[f"{p}.mixer.shared_experts.up_proj"] = (32, H)
            lin[f"{p}.mixer.shared_experts.down_proj"] = (H, 32)
            extra[f"{p}.mixer.gate.weight"] = ("F32", (E, H))
            extra[f"{p}.mixer.gate.e_score_correction_bias"] = ("F32", (E,))
        else:
            for n, o in (("q_proj", H), ("k_proj", 32), ("v_proj", 32), ("o_proj", H)):
                lin[f"{p}.mixer.{n}"] = (o, H)
    lin["lm_head"] = (V, H)
    lin["mtp.layers.0.eh_proj"] = (H, 2 * H)
    extra.update({"backbone.embeddings.weight": ("BF16", (V, H)),
                  "backbone.norm_f.weight": ("BF16", (H,)),
                  "mtp.layers.0.enorm.weight": ("BF16", (H,))})
    return lin, extra


def _module_algo_target(algo: str, prefix: str):
    """Which format each module gets: mirrors NVIDIA's recipe (attention, the Mamba layer
    before attention, lm_head in BF16; the mixed model has FP8 Mamba and NVFP4 experts)."""
    if prefix == "lm_head" or ".layers.3." in prefix or "gate" in prefix:
        return None
    if algo == "MIXED_PRECISION":
        if prefix.startswith("backbone.layers.0.mixer."):
            return "FP8"
        if prefix.startswith("backbone.layers.2."):
            return None
        return "W4A16_NVFP4"
    if prefix.startswith("backbone.layers.2.mixer."):
        return None
    return algo


def _add_module(tensors, rng, prefix, shape, algo, with_input_scale):
    w = (rng.standard_normal(shape) * rng.uniform(0.02, 0.2)).astype(np.float32)
    if algo in ("NVFP4", "W4A16_NVFP4"):
        packed, scale, ws2 = nvfp4_quantize(w)
        tensors[f"{prefix}.weight"] = ("U8", packed.shape, packed.tobytes())
        tensors[f"{prefix}.weight_scale"] = ("F8_E4M3", scale.shape, scale.tobytes())
        tensors[f"{prefix}.weight_scale_2"] = ("F32", (), np.float32(ws2).tobytes())
    elif algo == "FP8":
        q, s = fp8_quantize(w)
        tensors[f"{prefix}.weight"] = ("F8_E4M3", q.shape, q.tobytes())
        tensors[f"{prefix}.weight_scale"] = ("F32", (), np.float32(s).tobytes())
    else:
        tensors[f"{prefix}.weight"] = ("BF16", shape, bf16_bytes(w))
        return
    if with_input_scale:
        tensors[f"{prefix}.input_scale"] = ("F32", (), np.float32(0.5).tobytes())


def _add_extra(tensors, rng, name, dtype, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    tensors[name] = (dtype, shape, bf16_bytes(x) if dtype == "BF16" else x.astype("<f4").tobytes())


def _write(path: Path, tensors: dict, config: dict, hf_quant: dict | None, shards: int,
           rng) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    rng.shuffle(names)                          # source order must not matter
    if shards == 1:
        write_raw_safetensors(path / "model.safetensors", {n: tensors[n] for n in names},
                              {"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = names[k::shards]
            write_raw_safetensors(path / fname, {n: tensors[n] for n in part}, {"format": "pt"})
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (path / "generation_config.json").write_text('{"eos_token_id": 2}')
    (path / "README.md").write_text("synthetic test checkpoint\n")


def synth_target(path, algo="W4A16_NVFP4", *, shards=1, seed=0, edit=None) -> dict:
    """A tiny Nemotron-H export. ``edit(tensors, config, quant)`` may break it before writing.
    Returns the source tensors: name -> (dtype, shape, bytes)."""
    rng = np.random.default_rng(seed)
    lin, extra = _target_modules()
    tensors = {}
    for prefix, shape in lin.items():
        _add_module(tensors, rng, prefix, shape, _module_algo_target(algo, prefix),
                    with_input_scale=algo in ("NVFP4", "FP8"))
    for name, (dtype, shape) in extra.items():
        _add_extra(tensors, rng, name, dtype, shape)
    if algo == "FP8":                           # FP8 KV cache scales ride along in FP8 exports
        tensors["backbone.layers.3.mixer.k_proj.k_scale"] = ("F32", (), np.float32(1).tobytes())
        tensors["backbone.layers.3.mixer.v_proj.v_scale"] = ("F32", (), np.float32(1).tobytes())

    if algo == "MIXED_PRECISION":
        layers = {}
        for prefix in lin:
            a = _module_algo_target(algo, prefix)
            if a is not None:
                key = prefix.rsplit(".", 2)[0] if ".experts." in prefix else prefix
                layers[key] = {"quant_algo": a, "group_size": 16} if "NVFP4" in a else {"quant_algo": a}
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "quantized_layers": layers}
    else:
        quant = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if algo == "FP8" else None,
                 "group_size": 16,
                 "exclude_modules": ["lm_head", f"backbone.layers.3.{SENTINEL}*",
                                     f"backbone.layers.2.mixer.in_proj.{SENTINEL}",
                                     "backbone.layers.2.mixer.out_proj"]}
    config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": H, "vocab_size": V, "num_hidden_layers": len(TARGET_PATTERN),
        "layers_block_type": [BLOCK_TYPE[c] for c in TARGET_PATTERN],
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
        "conv_kernel": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "n_routed_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32, "num_nextn_predict_layers": 1,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", **{k: v for k, v in quant.items()
                                                              if k != "exclude_modules"},
                                "ignore": quant.get("exclude_modules", [])},
    }
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}
    if edit is not None:
        edit(tensors, config, quant)
    _write(Path(path), tensors, config, hf_quant, shards, rng)
    return tensors


def synth_drafter(path, *, seed=1, prefix="", edit=None) -> dict:
    """A tiny NVIDIA-layout DSpark drafter (DESIGN §6 names), W4A16_NVFP4, configured through
    config.json's quantization_config only (no hf_quant_config.json)."""
    rng = np.random.default_rng(seed)
    taps, inter, rank, heads = 2, 128, 32, 4
    tensors = {}
    lin = {"fc": (H, taps * H), "markov_head.markov_w2": (V, rank)}
    dense = {"embed_tokens": (V, H), "markov_head.markov_w1": (V, rank)}
    extra = {"hidden_norm.weight": ("BF16", (H,)), "norm.weight": ("BF16", (H,))}
    for i in range(2):
        p = f"layers.{i}"
        lin.update({f"{p}.mlp.gate_proj": (inter, H), f"{p}.mlp.up_proj": (inter, H),
                    f"{p}.mlp.down_proj": (H, inter)})
        dense.update({f"{p}.self_attn.q_proj": (H, H), f"{p}.self_attn.k_proj": (32, H),
                      f"{p}.self_attn.v_proj": (32, H), f"{p}.self_attn.o_proj": (H, H)})
        extra.update({f"{p}.input_layernorm.weight": ("BF16", (H,)),
                      f"{p}.post_attention_layernorm.weight": ("BF16", (H,)),
                      f"{p}.self_attn.q_norm.weight": ("BF16", (16,)),
                      f"{p}.self_attn.k_norm.weight": ("BF16", (16,)),
                      f"{p}.self_attn.attention_sink_bias": ("BF16", (heads,))})
    for name, shape in lin.items():
        _add_module(tensors, rng, name, shape, "W4A16_NVFP4", False)
    for name, shape in dense.items():
        _add_module(tensors, rng, name, shape, None, False)
    for name, (dtype, shape) in extra.items():
        _add_extra(tensors, rng, name, dtype, shape)
    tensors = {prefix + n: t for n, t in tensors.items()}
    config = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "sliding_window": 1024, "block_size": 8, "mask_token_id": 5,
        "target_layer_ids": [1, 3], "markov_rank": rank, "dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
                                "group_size": 16,
                                "ignore": ["embed_tokens", "layers.*.self_attn*",
                                           "markov_head.markov_w1"]},
    }
    if edit is not None:
        edit(tensors, config, config["quantization_config"])
    _write(Path(path), tensors, config, None, 1, rng)
    return tensors
