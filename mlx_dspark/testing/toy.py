"""Random-weight models of any shape, for the loop benchmark and the tests: our Nemotron-H
target on the weights of mlx-lm's ``nemotron_h`` drawn at random (the same weights under the
checkpoint names, so the tests can compare the two implementations), and a DSpark drafter in
NVIDIA's layout with random weights (a useless drafter: its acceptance is near 1/vocab)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import drafter as D
from .. import drafter_config as DC
from ..open_files import import_mlx_lm
from ..target import NemotronH, TargetConfig

mlx_lm_nh = import_mlx_lm("mlx_lm.models.nemotron_h")


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


def tiny_target(seed=0, dtype=mx.float32, **over) -> NemotronH:
    cfg = tiny_config(**over)
    return NemotronH(TargetConfig.from_dict(cfg),
                     hf_weights_from_mlx_lm(random_mlx_lm_model(cfg, seed), stacked=True), dtype)


def random_drafter(target, seed=0, layers=2, window=16, tap_layers=(0, 2)) -> D.Drafter:
    """NVIDIA's drafter layout at toy size, every weight random (dense float32)."""
    tc = target.config
    cfg = DC.DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=tc.vocab_size, rms_norm_eps=1e-6,
        rope_theta=10000.0, windows=(window,) * layers, attention_sinks=True, block_size=8,
        mask_token_id=tc.vocab_size - 1, target_layer_ids=tuple(tap_layers),
        target_hidden_size=tc.hidden_size, markov_rank=8,
        has_embed_tokens=False)
    mx.random.seed(seed)
    w = {}
    for name, shape in DC._expected_plain(cfg).items():
        w[name] = (1.0 + 0.1 * mx.random.normal(shape)) if name.endswith("norm.weight") \
            else mx.random.normal(shape) * 0.3
    for prefix, (out, inp) in DC._expected_linears(cfg).items():
        w[prefix + ".weight"] = mx.random.normal((out, inp)) * inp ** -0.5
    drafter = D.Drafter(cfg, w, target, mx.float32, share_embedding=True)
    mx.eval(drafter.parameters())
    return drafter
