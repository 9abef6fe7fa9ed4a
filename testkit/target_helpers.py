"""Tiny random Nemotron-H models for the target tests: the same weights for our target and for
mlx-lm's ``nemotron_h`` (an independent implementation; the random models: testkit.toy)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import nemotron_h as mlx_lm_nh

from mlx_dspark.models.nemotron_h import NemotronH, TargetConfig
from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model


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
