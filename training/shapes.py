"""Candidate target shapes (transformers NemotronHConfig keyword arguments) and the chosen one.

Every dimension a quantized linear sees as its input is a multiple of 16 (NVFP4 blocks).
"""

VOCAB = 4096


def _shape(hidden, pattern, mamba_heads, moe_inter, shared_inter, experts, topk, heads=4, kv=2):
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        hybrid_override_pattern=pattern,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=32,
        ssm_state_size=32,
        n_groups=2,
        conv_kernel=4,
        intermediate_size=moe_inter,
        moe_intermediate_size=moe_inter,
        moe_shared_expert_intermediate_size=shared_inter,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=topk,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        chunk_size=64,  # HF training-path scan chunk; smaller is cheaper here, inference ignores it
        layer_norm_epsilon=1e-5,
        attention_bias=False,
        mamba_proj_bias=False,
        mlp_bias=False,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
    )


CANDIDATES = {
    "h192-L6": _shape(192, "MEM*EM", 6, 256, 256, 8, 2),
    "h256-L8": _shape(256, "MEM*EMEM", 8, 256, 512, 8, 2),
    "h384-L8": _shape(384, "MEM*EMEM", 12, 384, 768, 8, 2),
    "h512-L10": _shape(512, "MEM*EMEM*E", 16, 512, 1024, 8, 2),
}


# Chosen from training/measure_ratio.py (README): the smallest shape that still holds all three
# block kinds with room to learn; its 4-token/1-token forward ratio is the lowest measured.
TARGET = "h192-L6"
# Drafter taps: 0-based target layers whose pre-final-norm residual the drafter reads
# (docs/design.md §5.1): an early, a middle and the last layer, like NVIDIA's spread over the depth.
TARGET_LAYER_IDS = [1, 3, 5]


def hf_config_kwargs(name=TARGET):
    return dict(CANDIDATES[name])


def mlx_args(cfg):
    """The same shape in mlx-lm's ModelArgs vocabulary (for random-weight timing)."""
    return dict(cfg, model_type="nemotron_h", layers_block_type=None,
                num_hidden_layers=len(cfg["hybrid_override_pattern"]),
                hybrid_override_pattern=list(cfg["hybrid_override_pattern"]))
