"""Tiny random Nemotron-H models for the target tests: the same weights
for our target and for mlx-lm's ``nemotron_h`` (an independent implementation)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import nemotron_h as mlx_lm_nh

from mlx_dspark.target import NemotronH, TargetConfig


def tiny_config(pattern="M*EM-E", **over) -> dict:
    cfg = dict(
        model_type="nemotron_h", vocab_size=97, hidden_size=64, intermediate_size=96,
        max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, attention_bias=False, mamba_num_heads=8, mamba_head_dim=8,
        mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=pattern, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, n_routed_experts=8,
        n_shared_experts=1, topk_group=1, num_experts_per_tok=3, norm_topk_prob=True,
        routed_scaling_factor=2.5, chunk_size=16, time_step_limit=[0.0, float("inf")],
    )
    cfg.update(over)
    return cfg


def random_mlx_lm_model(cfg: dict, seed=0):
    """mlx-lm's model with every parameter drawn at random (its own init leaves the router
    at zero, which would never exercise routing)."""
    mx.random.seed(seed)
    model = mlx_lm_nh.Model(mlx_lm_nh.ModelArgs.from_dict(cfg))
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log"):
            v = mx.log(mx.random.uniform(1.0, 16.0, v.shape))
        elif k.endswith(("dt_bias", "D")):
            v = mx.random.normal(v.shape)
        elif k.endswith("norm.weight") or k.endswith("norm_f.weight"):
            v = 1.0 + 0.2 * mx.random.normal(v.shape)
        elif k.endswith("e_score_correction_bias"):
            v = 0.3 * mx.random.normal(v.shape)
        elif k.endswith("conv1d.bias"):
            v = 0.3 * mx.random.normal(v.shape)
        else:
            v = mx.random.normal(v.shape) * (v.shape[-1] if v.ndim > 1 else 1) ** -0.5
            if k.endswith("conv1d.weight"):
                v = mx.random.normal(v.shape) * 0.5
        new.append((k, v))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


def hf_weights_from_mlx_lm(model, stacked=False) -> dict:
    """mlx-lm's parameters under the HF checkpoint names (inverse of its ``sanitize``):
    conv1d ``(C, 1, K)``, experts per expert (or already stacked, as the converter writes)."""
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)
        if ".switch_mlp." in k:
            proj = "up_proj" if ".fc1." in k else "down_proj"
            base = k.split(".switch_mlp.")[0] + ".experts"
            if stacked:
                out[f"{base}.{proj}.weight"] = v
            else:
                for e in range(v.shape[0]):
                    out[f"{base}.{e}.{proj}.weight"] = v[e]
            continue
        out[k] = v
    return out


def twin_models(cfg: dict, seed=0, dtype=mx.float32):
    """(ours, mlx-lm's) on identical random weights."""
    ref = random_mlx_lm_model(cfg, seed)
    ours = NemotronH(TargetConfig.from_dict(cfg), hf_weights_from_mlx_lm(ref, stacked=True),
                     dtype)
    return ours, ref


def _is_linear(name: str, v) -> bool:
    return (name.endswith("_proj.weight") and v.ndim in (2, 3)
            and ".gate." not in name and "conv1d" not in name)


def quantize_like_modelopt(hf_weights: dict, fp8=("out_proj",)) -> tuple[dict, dict]:
    """A converted-layout checkpoint made from float weights, plus the float weights it
    stands for (``e2m1·e4m3·ws2`` / ``fp8·scale`` in fp32) to feed a reference model.

    Linear layers whose name contains one of ``fp8`` become per-tensor FP8, every other
    projection NVFP4 with ModelOpt's tensor scale ``amax / (6·448)`` (per expert when
    stacked); the rest (embeddings, norms, router, conv, lm_head) stays float."""
    conv, deq = {}, {}
    for k, v in hf_weights.items():
        if not _is_linear(k, v) or k.startswith("lm_head"):
            conv[k] = deq[k] = v
            continue
        p = k[: -len(".weight")]
        lead = v.shape[:-2]
        amax = mx.abs(v).reshape(*lead, -1).max(axis=-1)
        if any(f in k for f in fp8):
            scale = amax / 448.0
            raw = mx.to_fp8(v / scale[..., None, None])
            conv[f"{p}.weight"], conv[f"{p}.weight_scale"] = raw, scale
            deq[k] = mx.from_fp8(raw, dtype=mx.float32) * scale[..., None, None]
        else:
            ws2 = amax / (6.0 * 448.0)
            q, s = mx.quantize(v / ws2[..., None, None], group_size=16, bits=4, mode="nvfp4")
            conv[f"{p}.weight"], conv[f"{p}.scales"], conv[f"{p}.weight_scale_2"] = q, s, ws2
            deq[k] = mx.dequantize(q, s, group_size=16, bits=4, mode="nvfp4",
                                   dtype=mx.float32) * ws2[..., None, None]
    return conv, deq


def mlx_lm_from_hf_weights(cfg: dict, hf_weights: dict):
    """mlx-lm's model loaded with HF-named float weights (through its own ``sanitize``)."""
    model = mlx_lm_nh.Model(mlx_lm_nh.ModelArgs.from_dict(cfg))
    w = dict(hf_weights)
    for k in [k for k in w if ".experts." in k]:
        if w[k].ndim == 3:                        # stacked: unstack for sanitize
            stack = w.pop(k)
            base, proj = k.split(".experts.")
            for e in range(stack.shape[0]):
                w[f"{base}.experts.{e}.{proj}"] = stack[e]
    model.load_weights(list(model.sanitize(w).items()))
    mx.eval(model.parameters())
    return model
