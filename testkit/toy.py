"""Random-weight models of any shape, for the loop benchmark and the tests: our Nemotron-H
target on the weights of mlx-lm's ``nemotron_h`` drawn at random (the same weights under the
checkpoint names, so the tests can compare the two implementations), and DSpark, DFlash, MTP
and EAGLE-3 drafters with random weights (useless drafters: their acceptance is near 1/vocab)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dspark.drafters import dspark as D
from mlx_dspark.drafters import config as DC
from mlx_dspark.models.nemotron_h import NemotronH, TargetConfig
from mlx_dspark.open_files import import_mlx_lm

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


def random_drafter(target, seed=0, layers=2, window=16, tap_layers=(0, 2)) -> D.DSparkDrafter:
    """NVIDIA's drafter layout at toy size, every weight random (dense float32)."""
    tc = target.config
    cfg = DC.DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=tc.vocab_size, rms_norm_eps=1e-6,
        rope_theta=10000.0, windows=(window,) * layers, attention_sinks=True, block_size=8,
        mask_token_id=tc.vocab_size - 1, target_layer_ids=tuple(tap_layers),
        target_hidden_size=tc.hidden_size, markov_rank=8,
        has_embed_tokens=False)
    drafter = D.DSparkDrafter(cfg, random_block_weights(cfg, seed), target, mx.float32,
                              share_embedding=True)
    mx.eval(drafter.parameters())
    return drafter


def random_block_weights(cfg: DC.DrafterConfig, seed=0) -> dict:
    """Random dense float32 tensors for every tensor a DSpark or DFlash ``cfg`` implies."""
    mx.random.seed(seed)
    w = {}
    for name, shape in DC._expected_plain(cfg).items():
        w[name] = (1.0 + 0.1 * mx.random.normal(shape)) if name.endswith("norm.weight") \
            else mx.random.normal(shape) * 0.3
    for prefix, (out, inp) in DC._expected_linears(cfg).items():
        w[prefix + ".weight"] = mx.random.normal((out, inp)) * inp ** -0.5
    mx.eval(w)
    return w


def dflash_config(target, layers=2, windows=(None, 5), block_size=8, tap_layers=(0, 2),
                  **over) -> dict:
    """A z-lab DFlash ``config.json`` at toy size for ``target``: by default a full-attention
    layer and a sliding one whose window (5) is narrower than the block, both non-causal.
    ``over`` replaces top-level fields (None: drops the field)."""
    tc = target.config
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": tc.hidden_size, "intermediate_size": 2 * tc.hidden_size,
           "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": tc.vocab_size, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "block_size": block_size, "is_causal": False,
           "layer_types": ["full_attention" if w is None else "sliding_attention"
                           for w in windows],
           "sliding_window": next((w for w in windows if w), None),
           "dflash_config": {"mask_token_id": tc.vocab_size - 1,
                             "target_layer_ids": list(tap_layers)}}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def random_dflash(target, seed=0, **config):
    """The DFlash drafter of :func:`dflash_config` with random weights (a useless drafter)."""
    from mlx_dspark.drafters.dflash import DFlashDrafter, parse_config
    cfg = parse_config(dflash_config(target, **config), "toy")
    drafter = DFlashDrafter(cfg, random_block_weights(cfg, seed), target, mx.float32,
                            share_embedding=True)
    mx.eval(drafter.parameters())
    return drafter


def random_mtp_weights(target, pattern="*E", seed=0) -> dict:
    """NVIDIA's ``mtp.*`` block for ``target`` at toy size, every weight random (dense
    float32, experts stacked as the converter writes them)."""
    c = target.config
    h, hd = c.hidden_size, c.head_dim or c.hidden_size // c.num_attention_heads
    mx.random.seed(seed)

    def lin(out, inp):
        return mx.random.normal((out, inp)) * inp ** -0.5

    w = {}
    for i, kind in enumerate(pattern):
        p = f"mtp.layers.{i}"
        w[f"{p}.norm.weight"] = 1.0 + 0.2 * mx.random.normal((h,))
        if kind == "*":
            w[f"{p}.mixer.q_proj.weight"] = lin(c.num_attention_heads * hd, h)
            w[f"{p}.mixer.k_proj.weight"] = lin(c.num_key_value_heads * hd, h)
            w[f"{p}.mixer.v_proj.weight"] = lin(c.num_key_value_heads * hd, h)
            w[f"{p}.mixer.o_proj.weight"] = lin(h, c.num_attention_heads * hd)
        else:
            e, m, s = c.n_routed_experts, c.moe_intermediate_size, \
                c.moe_shared_expert_intermediate_size
            w[f"{p}.mixer.gate.weight"] = mx.random.normal((e, h)) * h ** -0.5
            w[f"{p}.mixer.gate.e_score_correction_bias"] = 0.3 * mx.random.normal((e,))
            w[f"{p}.mixer.experts.up_proj.weight"] = mx.random.normal((e, m, h)) * h ** -0.5
            w[f"{p}.mixer.experts.down_proj.weight"] = mx.random.normal((e, h, m)) * m ** -0.5
            w[f"{p}.mixer.shared_experts.up_proj.weight"] = lin(s, h)
            w[f"{p}.mixer.shared_experts.down_proj.weight"] = lin(h, s)
    w["mtp.layers.0.enorm.weight"] = 1.0 + 0.2 * mx.random.normal((h,))
    w["mtp.layers.0.hnorm.weight"] = 1.0 + 0.2 * mx.random.normal((h,))
    w["mtp.layers.0.eh_proj.weight"] = lin(h, 2 * h)
    w[f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight"] = \
        1.0 + 0.2 * mx.random.normal((h,))
    mx.eval(w)
    return w


def random_mtp(target, pattern="*E", seed=0):
    """The MTP drafter over :func:`random_mtp_weights` (a useless drafter)."""
    from mlx_dspark.drafters.mtp import MTPDrafter
    drafter = MTPDrafter(target, random_mtp_weights(target, pattern, seed), pattern)
    mx.eval(drafter.parameters())
    return drafter


def random_eagle3_weights(target, draft_vocab=48, aux=(1, 3, 5), seed=0,
                          own_embedding=False) -> tuple[dict, dict]:
    """An EAGLE-3 head for ``target`` in SpecForge's layout at toy size, every weight random
    (dense float32), its draft vocabulary a random sorted subset of the target's; returns
    (weights, config.json fields)."""
    import numpy as np
    c = target.config
    h, v = c.hidden_size, c.vocab_size
    heads, kv, hd, inter = 4, 2, 16, 2 * h
    mx.random.seed(seed)

    def lin(out, inp):
        return mx.random.normal((out, inp)) * inp ** -0.5

    keep = np.sort(np.random.default_rng(seed).choice(v, draft_vocab, replace=False))
    t2d = np.zeros(v, bool)
    t2d[keep] = True
    w = {"fc.weight": lin(h, len(aux) * h), "norm.weight": 1 + 0.2 * mx.random.normal((h,)),
         "lm_head.weight": lin(draft_vocab, h),
         "d2t": mx.array(keep - np.arange(draft_vocab), dtype=mx.int64),
         "t2d": mx.array(t2d)}
    m = "midlayer"
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{m}.{n}.weight"] = 1 + 0.2 * mx.random.normal((h,))
    w.update({f"{m}.self_attn.q_proj.weight": lin(heads * hd, 2 * h),
              f"{m}.self_attn.k_proj.weight": lin(kv * hd, 2 * h),
              f"{m}.self_attn.v_proj.weight": lin(kv * hd, 2 * h),
              f"{m}.self_attn.o_proj.weight": lin(h, heads * hd),
              f"{m}.mlp.gate_proj.weight": lin(inter, h), f"{m}.mlp.up_proj.weight": lin(inter, h),
              f"{m}.mlp.down_proj.weight": lin(h, inter)})
    if own_embedding:
        w["embed_tokens.weight"] = mx.random.normal((v, h))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "vocab_size": v, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "hidden_act": "silu", "target_hidden_size": h,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux],
                               "use_aux_hidden_state": True}}
    mx.eval(w)
    return w, config


def random_eagle3(target, **kw):
    """The EAGLE-3 drafter over :func:`random_eagle3_weights` (a useless drafter)."""
    from mlx_dspark.drafters.eagle3 import Eagle3Drafter, parse_config
    w, config = random_eagle3_weights(target, **kw)
    cfg = parse_config(config, "toy", target.config.num_hidden_layers)
    drafter = Eagle3Drafter(cfg, w, target, mx.float32, "embed_tokens.weight" not in w)
    mx.eval(drafter.parameters())
    return drafter
