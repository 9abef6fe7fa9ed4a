"""What drafter training and its evaluation share, in PyTorch: the target's taps a drafter
reads, and the packed (NVFP4) drafter loaded back as a trainable float model. Its own module so
that train_drafter.py (which starts from a packed drafter with ``--init``) and eval_drafter.py
(which reads the taps) import it, not each other."""
import json

import torch
from safetensors.torch import load_file

from modelopt.torch.quantization.qtensor import NVFP4QTensor

from data import WORK
from drafter_model import DrafterConfig, DSparkDrafter
from shapes import TARGET_LAYER_IDS

PACKED = WORK / "drafter_nvfp4"


@torch.no_grad()
def target_taps(target, ids):
    """Pre-final-norm residual streams after TARGET_LAYER_IDS, concatenated: [B, T, n*h]."""
    out = {}
    hooks = [target.model.layers[i].register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, o))
             for i in TARGET_LAYER_IDS]
    logits = target(ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    return torch.cat([out[i] for i in TARGET_LAYER_IDS], -1), logits


def load_packed_drafter(path=PACKED):
    cfg = json.loads((path / "config.json").read_text())
    c = DrafterConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        vocab_size=cfg["vocab_size"], target_layer_ids=cfg["target_layer_ids"],
        sliding_window=cfg["sliding_window"], markov_rank=cfg["markov_rank"],
        mask_token_id=cfg["mask_token_id"], block_size=cfg["block_size"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"])
    t = load_file(path / "model.safetensors")
    sd = {}
    for name, w in t.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_2"):
            continue
        if w.dtype == torch.uint8:
            q = NVFP4QTensor(torch.Size([w.shape[0], w.shape[1] * 2]), torch.float32, w)
            w = q.dequantize(dtype=torch.float32, scale=t[prefix + ".weight_scale"],
                             double_scale=t[prefix + ".weight_scale_2"], block_sizes={-1: 16})
        sd[name] = w.float()
    d = DSparkDrafter(c)
    d.load_state_dict(sd)
    return d.eval()
