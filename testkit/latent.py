"""Tiny latent-MoE Nemotron-H checkpoints (Nemotron 3 Super's and Ultra's ``moe_latent_size``)
made from mlx-lm's own ``nemotron_h`` model with random weights, in the three layouts a user
meets: Hugging Face's (per-expert tensors, an ``mtp.*`` block whose MoE layer is latent too),
mlx-lm's (``mlx_lm.convert`` of that directory) and a ModelOpt NVFP4 export (the NumPy
quantizer of testing/codecs.py; the latent projections quantized too, or left in BF16 as a
recipe that excludes them writes them). mlx-lm's model on the same weights is the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from testkit.codecs import bf16_bytes, nvfp4_dequantize, nvfp4_quantize, write_raw_safetensors
from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config

LATENT = 32
"""The toy's latent width (its hidden size is 64): a multiple of every MLX group size."""

MTP_PATTERN = "*E"


def latent_config(**over) -> dict:
    """The toy Nemotron-H of testing/toy.py with a latent MoE, as a config.json."""
    return {"architectures": ["NemotronHForCausalLM"],
            **tiny_config(moe_latent_size=LATENT, **over)}


def random_latent_mtp(model, cfg: dict, seed=7) -> dict:
    """An ``mtp.*`` block (pattern ``*E``) for ``model`` in NVIDIA's names, per-expert tensors,
    its MoE layer latent as the target's are: mlx-lm's own MoE layer at random supplies the
    MoE tensors, the rest are drawn here."""
    from mlx_dspark.open_files import import_mlx_lm
    nh = import_mlx_lm("mlx_lm.models.nemotron_h")
    mx.random.seed(seed)
    h = cfg["hidden_size"]
    hd = cfg["head_dim"]

    def lin(out, inp):
        return mx.random.normal((out, inp)) * inp ** -0.5

    moe = nh.NemotronHMoE(nh.ModelArgs.from_dict(cfg))
    w = {}
    for k, v in tree_flatten(moe.parameters()):
        v = 0.3 * mx.random.normal(v.shape) if k.endswith("e_score_correction_bias") else \
            mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        if k.startswith("switch_mlp."):
            proj = "up_proj" if ".fc1." in k else "down_proj"
            for e in range(v.shape[0]):
                w[f"mtp.layers.1.mixer.experts.{e}.{proj}.weight"] = v[e]
        else:
            w[f"mtp.layers.1.mixer.{k}"] = v
    q = f"mtp.layers.0.mixer"
    w.update({f"{q}.q_proj.weight": lin(cfg["num_attention_heads"] * hd, h),
              f"{q}.k_proj.weight": lin(cfg["num_key_value_heads"] * hd, h),
              f"{q}.v_proj.weight": lin(cfg["num_key_value_heads"] * hd, h),
              f"{q}.o_proj.weight": lin(h, cfg["num_attention_heads"] * hd),
              "mtp.layers.0.eh_proj.weight": lin(h, 2 * h)})
    for n in ("layers.0.norm", "layers.1.norm", "layers.0.enorm", "layers.0.hnorm",
              "layers.1.final_layernorm"):
        w[f"mtp.{n}.weight"] = 1.0 + 0.2 * mx.random.normal((h,))
    mx.eval(w)
    return w


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer with one word per id (``t0`` ... ), ``t2`` its end of sequence:
    what ``mlx_lm.convert`` and ``md.load`` need beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0"
                            ).save_pretrained(out)


def save_hf(out, seed=0, mtp=True, **over):
    """A latent toy in the Hugging Face layout under ``out`` (float32, experts one tensor set
    each, an MTP block unless ``mtp`` is False, a tokenizer); returns (``out``, mlx-lm's model
    on the same weights)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = latent_config(**over)
    model = random_mlx_lm_model(cfg, seed)
    weights = hf_weights_from_mlx_lm(model)
    if mtp:
        weights.update(random_latent_mtp(model, cfg))
        cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=MTP_PATTERN)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out, cfg["vocab_size"])
    return out, model


def modelopt_nvfp4(hf, out, quantize_latent=True):
    """The Hugging Face directory ``hf`` as a ModelOpt W4A16_NVFP4 export: every linear whose
    input is a multiple of 16 quantized (experts, projections, lm_head), routers, norms, the
    Mamba scalars and the embedding as BF16 or float32 as NVIDIA ships them; the latent
    projections left in BF16 unless ``quantize_latent``. Returns the export's path and the
    dense float32 tensors it stands for (NVFP4 dequantized exactly, BF16 rounded), the
    oracle's weights."""
    hf, out = Path(hf), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = mx.load(str(hf / "model.safetensors"))
    raw, dense, excluded = {}, {}, []
    for name, v in sorted(src.items()):
        a = np.array(v.astype(mx.float32))
        prefix = name[:-len(".weight")]
        linear = name.endswith(".weight") and a.ndim == 2 and "embeddings" not in name \
            and ".gate." not in name and not name.endswith("norm.weight")
        latent = "_latent_proj" in name
        if linear and a.shape[1] % 16 == 0 and (quantize_latent or not latent):
            packed, scale, ws2 = nvfp4_quantize(a)
            raw[name] = ("U8", packed.shape, packed.tobytes())
            raw[f"{prefix}.weight_scale"] = ("F8_E4M3", scale.shape, scale.tobytes())
            raw[f"{prefix}.weight_scale_2"] = ("F32", (), np.float32(ws2).tobytes())
            dense[name] = nvfp4_dequantize(packed, scale, ws2)
            continue
        if linear:
            excluded.append(prefix)
        if ".gate." in name or name.endswith(("A_log", "D")):
            raw[name] = ("F32", a.shape, a.astype("<f4").tobytes())
            dense[name] = a
        else:
            raw[name] = ("BF16", a.shape, bf16_bytes(a))
            dense[name] = np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))
    write_raw_safetensors(out / "model.safetensors", raw, {"format": "pt"})
    quant = {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": excluded}
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
                                  "group_size": 16, "ignore": excluded}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}))
    write_tokenizer(out, cfg["vocab_size"])
    return out, {k: mx.array(v) for k, v in dense.items()}


def mlx_lm_model_on(cfg: dict, hf_weights: dict):
    """mlx-lm's ``nemotron_h`` holding ``hf_weights`` (Hugging Face names), float32."""
    from mlx_dspark.open_files import import_mlx_lm
    nh = import_mlx_lm("mlx_lm.models.nemotron_h")
    model = nh.Model(nh.ModelArgs.from_dict(cfg))
    w = model.sanitize({k: v.astype(mx.float32) for k, v in hf_weights.items()})
    model.load_weights(list(w.items()))
    mx.eval(model.parameters())
    return model
