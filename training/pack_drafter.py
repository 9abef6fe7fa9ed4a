"""Step 5b: write the trained drafter as NVIDIA's DSpark checkpoint (docs/design.md §6).

NVIDIA's drafter is not a transformers model, so `export_hf_checkpoint` does not apply; the
packing uses ModelOpt's own export pieces in the order its HF exporter runs them:
`mtq.quantize` (W4A16_NVFP4 on fc, mlp.* and markov_head.markov_w2; attention, norms and
markov_w1 stay BF16), `get_quant_config`, `preprocess_linear_fusion` on gate/up (they share an
input, so the exporter gives them one weight_scale_2), `_export_quantized_weight` per layer,
`postprocess_state_dict`. Tensor names are NVIDIA's, with no `model.` prefix.

    /work/venv-fx/bin/python training/pack_drafter.py   # work/drafter_torch -> work/drafter_nvfp4
"""
import json
import shutil

import torch
from safetensors.torch import save_file

from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

from data import WORK
from drafter_model import DrafterConfig, DSparkDrafter
from tokenizer import TOK_DIR

# One packing routine for the fixtures and the demo pair (dspark_drafter_export.py).
from dspark_drafter_export import pack

SRC = WORK / "drafter_torch"
OUT = WORK / "drafter_nvfp4"
DEMO_LABEL = ("mlx-dspark demonstration drafter trained on the Python standard library; "
              "a demonstration model, not Nemotron and not NVIDIA's DSpark release")


def nvidia_config(c: DrafterConfig, target_cfg: dict) -> dict:
    """config.json with the fields of NVIDIA's release (docs/design.md §6), at demo sizes."""
    dflash = {
        "causal": True,
        "use_swa": True,
        "swa_window_size": c.sliding_window,
        "attention_sink_bias": True,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": c.target_layer_ids,
    }
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "mlx_dspark_demo": DEMO_LABEL,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "layer_types": ["sliding_attention"] * c.num_hidden_layers,
        "sliding_window": c.sliding_window,
        "attention_sink_bias": True,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "num_target_layers": len(target_cfg["layers_block_type"]),
        "target_layer_ids": c.target_layer_ids,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "dflash_config": dflash,
        "dspark_bonus_anchor": True,
        "sample_from_anchor": False,
        "dspark_fixup_head_type": "markov",
        "markov_head_type": "vanilla",
        "markov_rank": c.markov_rank,
        "has_embed_tokens": True,
        "has_lm_head": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def main():
    c = DrafterConfig(**json.loads((SRC / "drafter_config.json").read_text()))
    model = DSparkDrafter(c)
    model.load_state_dict(torch.load(SRC / "drafter.pt"))
    tensors, hf_quant_config = pack(model)
    target_cfg = json.loads((WORK / "target_nvfp4" / "config.json").read_text())
    cfg = nvidia_config(c, target_cfg)
    cfg["quantization_config"] = convert_hf_quant_config_format(hf_quant_config)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (OUT / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOK_DIR / "hf" / f, OUT / f)
    print(f"{len(tensors)} tensors -> {OUT}")
    for k, v in tensors.items():
        print(f"  {k} {v.dtype} {tuple(v.shape)}")


if __name__ == "__main__":
    main()
