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

from mlx_dspark.checkpoint.pairing import LIGHTNING_PATTERN
from testkit.codecs import (E2M1,
    E4M3,
    bf16_bytes,
    nvfp4_quantize,
    nvfp4_dequantize,
    fp8_quantize,
    write_raw_safetensors,
    read_raw_checkpoint)

# ---------------------------------------------------------------- checkpoints

SENTINEL = "\u0000backbone.pt_name_sentinel"
H, V, E = 64, 128, 4                       # hidden, vocab, routed experts
TARGET_PATTERN = "MEM*E"
MTP_PATTERN = "*E"
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
    extra.update({"backbone.embeddings.weight": ("BF16", (V, H)),
                  "backbone.norm_f.weight": ("BF16", (H,))})
    mlin, mextra = mtp_modules(MTP_PATTERN, H, 4, 2, 16, E, 32, 32)
    lin.update(mlin)
    extra.update(mextra)
    return lin, extra


def mtp_modules(pattern, hidden, heads, kv_heads, head_dim, experts, moe_inter, shared_inter):
    """prefix -> (out, in) of the linear modules of a native MTP block in NVIDIA's layout (the
    fusion on its first layer, final_layernorm on its last), and its other tensors."""
    lin, extra = {}, {}
    for i, c in enumerate(pattern):
        p = f"mtp.layers.{i}"
        extra[f"{p}.norm.weight"] = ("BF16", (hidden,))
        if c == "E":
            for e in range(experts):
                lin[f"{p}.mixer.experts.{e}.up_proj"] = (moe_inter, hidden)
                lin[f"{p}.mixer.experts.{e}.down_proj"] = (hidden, moe_inter)
            lin[f"{p}.mixer.shared_experts.up_proj"] = (shared_inter, hidden)
            lin[f"{p}.mixer.shared_experts.down_proj"] = (hidden, shared_inter)
            extra[f"{p}.mixer.gate.weight"] = ("F32", (experts, hidden))
            extra[f"{p}.mixer.gate.e_score_correction_bias"] = ("F32", (experts,))
        else:
            for n, o in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                         ("v_proj", kv_heads * head_dim)):
                lin[f"{p}.mixer.{n}"] = (o, hidden)
            lin[f"{p}.mixer.o_proj"] = (hidden, heads * head_dim)
    lin["mtp.layers.0.eh_proj"] = (hidden, 2 * hidden)
    extra.update({"mtp.layers.0.enorm.weight": ("BF16", (hidden,)),
                  "mtp.layers.0.hnorm.weight": ("BF16", (hidden,)),
                  f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight": ("BF16", (hidden,))})
    return lin, extra


def add_mtp_block(src: Path, pattern="*E", seed=5) -> None:
    """Give a single-file Nemotron-H export a BF16 MTP block (random weights) in a second
    weight file, and the config fields that declare it."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    rng = np.random.default_rng(seed)
    lin, extra = mtp_modules(pattern, cfg["hidden_size"], cfg["num_attention_heads"],
                             cfg["num_key_value_heads"], cfg["head_dim"],
                             cfg["n_routed_experts"], cfg["moe_intermediate_size"],
                             cfg["moe_shared_expert_intermediate_size"])
    tensors = {}
    for prefix, shape in lin.items():
        _add_module(tensors, rng, prefix, shape, None, False)
    for name, (dtype, shape) in extra.items():
        _add_extra(tensors, rng, name, dtype, shape)
    write_raw_safetensors(src / "model-mtp.safetensors", tensors, {"format": "pt"})
    cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=pattern)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


def _module_algo_target(algo: str, prefix: str):
    """Which format each module gets: mirrors NVIDIA's recipe (attention, the Mamba layer
    before attention, lm_head in BF16; the mixed model has FP8 Mamba and NVFP4 experts)."""
    if prefix == "lm_head" or ".layers.3." in prefix or "gate" in prefix:
        return None
    if algo == "MIXED_PRECISION":
        if prefix.startswith(("backbone.layers.0.mixer.", "mtp.layers.0.mixer.")):
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
        "mtp_hybrid_override_pattern": MTP_PATTERN,
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
    """A tiny NVIDIA-layout DSpark drafter (names: design.md §6), W4A16_NVFP4, configured through
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


def synth_eagle3(path, *, seed=2, draft_vocab=96, aux=(2, 3, 5), vocab=V, edit=None) -> dict:
    """A tiny EAGLE-3 head for :func:`synth_target` in SpecForge's layout
    (``LlamaForCausalLMEagle3``): BF16, the MLP in W4A16_NVFP4, a reduced draft vocabulary with
    its ``d2t`` (I64) and ``t2d`` (BOOL) maps."""
    rng = np.random.default_rng(seed)
    heads, inter = 4, 128
    lin = {"fc": (H, len(aux) * H), "lm_head": (draft_vocab, H),
           "midlayer.self_attn.q_proj": (H, 2 * H), "midlayer.self_attn.k_proj": (32, 2 * H),
           "midlayer.self_attn.v_proj": (32, 2 * H), "midlayer.self_attn.o_proj": (H, H)}
    mlp = {"midlayer.mlp.gate_proj": (inter, H), "midlayer.mlp.up_proj": (inter, H),
           "midlayer.mlp.down_proj": (H, inter)}
    tensors = {}
    for name, shape in lin.items():
        _add_module(tensors, rng, name, shape, None, False)
    for name, shape in mlp.items():
        _add_module(tensors, rng, name, shape, "W4A16_NVFP4", False)
    for n in ("midlayer.input_layernorm", "midlayer.hidden_norm",
              "midlayer.post_attention_layernorm", "norm"):
        _add_extra(tensors, rng, f"{n}.weight", "BF16", (H,))
    keep = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    t2d = np.zeros(vocab, np.uint8)
    t2d[keep] = 1
    tensors["d2t"] = ("I64", (draft_vocab,), (keep - np.arange(draft_vocab)).astype("<i8").tobytes())
    tensors["t2d"] = ("BOOL", (vocab,), t2d.tobytes())
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu", "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux),
                         "use_aux_hidden_state": True},
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
                                "group_size": 16, "ignore": ["fc", "lm_head", "midlayer.self_attn*"]},
    }
    if edit is not None:
        edit(tensors, config, config["quantization_config"])
    _write(Path(path), tensors, config, None, 1, rng)
    return tensors


# ---------------------------------------------------------------- Lightning at real size
#
# NVIDIA Nemotron 3.5 Lightning 30B-A3B's shapes (docs/design.md §5; MoE sizes from the public
# 30B-A3B config: moe_intermediate_size 1856, shared expert 3712) in the quantization layout
# of its W4A16_NVFP4 export: NVFP4 routed and shared experts and Mamba projections, FP8 on
# some Mamba projections, BF16 attention, conv1d, embeddings and lm_head, F32 router. Which
# Mamba projections are FP8 is not public here (mere.run counts 46 FP8 tensors): by default
# those of the Mamba layer feeding each attention layer (``fp8_mamba="pre-attention"``;
# "all" and "none" bracket it). At 52 layers and 128 experts this is the real checkpoint's
# size (19.1 GB; "all" gives 19.4 GB).
#
# Weights are random *bytes* in valid codes, not quantized floats (quantizing 30B floats in
# NumPy would take hours); the scales are set so every linear keeps activations near unit
# RMS, so deep stacks stay finite. Everything streams: headers are computed from shapes,
# then each tensor is produced in bounded chunks and written straight to its shard.

LIGHTNING = dict(
    hidden_size=2688, vocab_size=131072, mamba_num_heads=64, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, num_attention_heads=32,
    num_key_value_heads=2, head_dim=128, n_routed_experts=128, num_experts_per_tok=6,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1,
    topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5,
)
_CHUNK = 16 << 20                                  # bytes produced at a time


def _rms(values) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(values, np.float64)))))


# Random codes as the fillers below draw them: any nibble; FP8 bytes with exponent field
# <= 7 (|x| < 2, never NaN); block scales 0x30..0x3F (0.5 .. 1.875).
_E2M1_RMS = _rms(E2M1)
_FP8_RMS = _rms(E4M3[[b & 0xBF for b in range(256)]])
_SCALE_RMS = _rms(E4M3[0x30:0x40])


def lightning_config(pattern: str = LIGHTNING_PATTERN, experts: int = 128,
                     vocab: int = 131072, top_k: int = 6) -> dict:
    cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
           **LIGHTNING, "vocab_size": vocab, "n_routed_experts": experts,
           "num_experts_per_tok": min(top_k, experts), "num_hidden_layers": len(pattern),
           "hybrid_override_pattern": pattern, "intermediate_size": 1856,
           "max_position_embeddings": 262144, "attention_bias": False, "mlp_bias": False,
           "mamba_proj_bias": False, "use_bias": False, "use_conv_bias": True,
           "n_shared_experts": 1, "time_step_limit": [0.0, {"__float__": "Infinity"}],
           "tie_word_embeddings": False, "dtype": "bfloat16"}
    return cfg


FP8_MAMBA = ("pre-attention", "all", "none")


def lightning_modules(cfg: dict, fp8_mamba: str = "pre-attention"):
    """(prefix, algo, (out, in)) of every linear, and (name, dtype, shape, fill) of the rest.
    ``algo`` is "W4A16_NVFP4", "FP8" or None (BF16)."""
    if fp8_mamba not in FP8_MAMBA:
        raise ValueError(f"fp8_mamba {fp8_mamba!r}: expected one of {', '.join(FP8_MAMBA)}")
    pattern = cfg["hybrid_override_pattern"]
    h, nh, hp = cfg["hidden_size"], cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    d_inner, gn = nh * hp, cfg["n_groups"] * cfg["ssm_state_size"]
    conv_dim = d_inner + 2 * gn
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, shared = cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
    lin, extra = [], []
    for i, c in enumerate(pattern):
        p = f"backbone.layers.{i}"
        extra.append((f"{p}.norm.weight", "BF16", (h,), "norm"))
        if c == "M":
            fp8 = fp8_mamba == "all" or (fp8_mamba == "pre-attention"
                                         and pattern[i + 1:i + 2] == "*")
            algo = "FP8" if fp8 else "W4A16_NVFP4"
            lin += [(f"{p}.mixer.in_proj", algo, (2 * d_inner + 2 * gn + nh, h)),
                    (f"{p}.mixer.out_proj", algo, (h, d_inner))]
            extra += [(f"{p}.mixer.conv1d.weight", "BF16", (conv_dim, 1, cfg["conv_kernel"]),
                       "conv"),
                      (f"{p}.mixer.conv1d.bias", "BF16", (conv_dim,), "small"),
                      (f"{p}.mixer.A_log", "F32", (nh,), "A_log"),
                      (f"{p}.mixer.D", "F32", (nh,), "norm"),
                      (f"{p}.mixer.dt_bias", "F32", (nh,), "dt_bias"),
                      (f"{p}.mixer.norm.weight", "BF16", (d_inner,), "norm")]
        elif c == "E":
            for e in range(cfg["n_routed_experts"]):
                lin += [(f"{p}.mixer.experts.{e}.up_proj", "W4A16_NVFP4", (inter, h)),
                        (f"{p}.mixer.experts.{e}.down_proj", "W4A16_NVFP4", (h, inter))]
            lin += [(f"{p}.mixer.shared_experts.up_proj", "W4A16_NVFP4", (shared, h)),
                    (f"{p}.mixer.shared_experts.down_proj", "W4A16_NVFP4", (h, shared))]
            extra += [(f"{p}.mixer.gate.weight", "F32", (cfg["n_routed_experts"], h), "linear"),
                      (f"{p}.mixer.gate.e_score_correction_bias", "F32",
                       (cfg["n_routed_experts"],), "small")]
        elif c == "*":
            lin += [(f"{p}.mixer.q_proj", None, (nq * hd, h)),
                    (f"{p}.mixer.k_proj", None, (nkv * hd, h)),
                    (f"{p}.mixer.v_proj", None, (nkv * hd, h)),
                    (f"{p}.mixer.o_proj", None, (h, nq * hd))]
        else:
            raise ValueError(f"pattern {cfg['hybrid_override_pattern']!r}: block kind {c!r} "
                             "is not part of Lightning (M, E, *)")
    extra += [("backbone.embeddings.weight", "BF16", (cfg["vocab_size"], h), "embed"),
              ("backbone.norm_f.weight", "BF16", (h,), "norm")]
    lin.append(("lm_head", None, (cfg["vocab_size"], h)))
    return lin, extra


def _bf16_chunks(rng, n: int, loc: float, std: float):
    step = _CHUNK // 2
    for s in range(0, n, step):
        x = loc + std * rng.standard_normal(min(step, n - s), np.float32)
        yield (x.view(np.uint32) >> 16).astype("<u2").tobytes()   # truncate to bf16


def _byte_chunks(rng, n: int, and_mask: int = 0xFF, or_mask: int = 0):
    for s in range(0, n, _CHUNK):
        b = np.frombuffer(rng.bytes(min(_CHUNK, n - s)), np.uint8)
        yield ((b & and_mask) | or_mask).astype(np.uint8).tobytes()


def _extra_chunks(rng, dtype, shape, fill):
    n = int(np.prod(shape))
    if fill == "A_log":
        x = np.log(rng.uniform(1, 16, n))
    elif fill == "dt_bias":                       # softplus^-1 of dt in [1e-3, 0.1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), n))
        x = dt + np.log(-np.expm1(-dt))
    else:
        loc, std = {"norm": (1.0, 0.1), "small": (0.0, 0.1), "conv": (0.0, 0.5),
                    "linear": (0.0, shape[-1] ** -0.5), "embed": (0.0, 1.0)}[fill]
        if dtype == "BF16":
            yield from _bf16_chunks(rng, n, loc, std)
            return
        x = loc + std * rng.standard_normal(n)
    yield np.asarray(x, "<f4").tobytes()


def _linear_tensors(rng, prefix, algo, shape):
    """(name, dtype, shape, chunk generator) of one linear module."""
    out, in_ = shape
    if algo == "W4A16_NVFP4":
        ws2 = np.float32(1 / (_E2M1_RMS * _SCALE_RMS * np.sqrt(in_)))
        return [(f"{prefix}.weight", "U8", (out, in_ // 2), _byte_chunks(rng, out * in_ // 2)),
                (f"{prefix}.weight_scale", "F8_E4M3", (out, in_ // 16),
                 _byte_chunks(rng, out * in_ // 16, 0x0F, 0x30)),
                (f"{prefix}.weight_scale_2", "F32", (), iter([ws2.tobytes()]))]
    if algo == "FP8":
        scale = np.float32(1 / (_FP8_RMS * np.sqrt(in_)))
        return [(f"{prefix}.weight", "F8_E4M3", shape, _byte_chunks(rng, out * in_, 0xBF)),
                (f"{prefix}.weight_scale", "F32", (), iter([scale.tobytes()]))]
    return [(f"{prefix}.weight", "BF16", shape, _bf16_chunks(rng, out * in_, 0.0, in_ ** -0.5))]


def _lightning_quant(lin) -> dict:
    layers = {}
    for prefix, algo, _ in lin:
        if algo is not None:
            key = prefix.rsplit(".", 2)[0] if ".experts." in prefix else prefix
            layers[key] = ({"quant_algo": algo, "group_size": 16} if "NVFP4" in algo
                           else {"quant_algo": algo})
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "quantized_layers": layers}


_NBYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def synth_lightning(path, *, layers: int = 52, experts: int = 128, vocab: int = 131072,
                    pattern: str | None = None, seed: int = 0, shard_bytes: int = 5 << 30,
                    fp8_mamba: str = "pre-attention", progress=None) -> int:
    """Write a Lightning-shaped ModelOpt export to ``path``; returns the bytes of weights.
    ``pattern`` defaults to the first ``layers`` blocks of the real pattern."""
    pattern = pattern or LIGHTNING_PATTERN[:layers]
    cfg = lightning_config(pattern, experts, vocab)
    lin, extra = lightning_modules(cfg, fp8_mamba)
    rng = np.random.default_rng(seed)
    # Shapes first (headers need every offset), bytes later (generators run at write time).
    tensors = [t for p, a, s in lin for t in _linear_tensors(rng, p, a, s)]
    tensors += [(n, d, s, _extra_chunks(rng, d, s, f)) for n, d, s, f in extra]
    shards, size = [[]], 0
    for t in tensors:
        nb = _NBYTES[t[1]] * int(np.prod(t[2]))
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((*t, nb))
        size += nb
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape, _, nb in group:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)              # data starts 8-byte aligned
        with open(path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, _, _, chunks, nb in group:
                written = 0
                for c in chunks:
                    f.write(c)
                    written += len(c)
                assert written == nb, name
                total += nb
                if progress:
                    progress(total)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    quant = _lightning_quant(lin)
    cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}, indent=2))
    (path / "generation_config.json").write_text('{"eos_token_id": 2}')
    (path / "README.md").write_text("synthetic Lightning-shaped checkpoint (random weights)\n")
    return total


def main(argv=None) -> int:
    import argparse
    import sys
    import time
    ap = argparse.ArgumentParser(
        prog="python -m testkit.synthetic",
        description="Write a synthetic ModelOpt W4A16_NVFP4 export with NVIDIA Nemotron 3.5 "
                    "Lightning's shapes and quantization layout (random weights).")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=52, help="first N blocks of the real pattern")
    ap.add_argument("--pattern", help="explicit block pattern (M, E, *) instead of --layers")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--fp8-mamba", default="pre-attention", choices=FP8_MAMBA,
                    help="which Mamba projections are FP8 (the rest NVFP4)")
    a = ap.parse_args(argv)
    if Path(a.out).exists() and any(Path(a.out).iterdir()):
        print(f"{a.out}: exists and is not empty", file=sys.stderr)
        return 2
    if not 1 <= a.layers <= len(LIGHTNING_PATTERN) or a.experts < 1 or a.vocab < 1:
        print("--layers must be 1..52, --experts and --vocab positive", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def progress(n):
        if sys.stderr.isatty():
            print(f"\r{n / 1e9:.2f} GB", end="", file=sys.stderr)
    try:
        n = synth_lightning(a.out, layers=a.layers, experts=a.experts, vocab=a.vocab,
                            pattern=a.pattern, seed=a.seed,
                            shard_bytes=int(a.shard_gb * (1 << 30)), fp8_mamba=a.fp8_mamba,
                            progress=progress)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"{a.out}: {n / 1e9:.2f} GB of weights in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
