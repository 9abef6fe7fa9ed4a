"""Step 4: quantize the trained target with ModelOpt (W4A16_NVFP4) and export it.

NVIDIA's recipe: NVFP4 weights, but attention layers and the Mamba layer right before each
attention layer stay BF16; ModelOpt's default config already leaves the router, conv1d,
embeddings and lm_head alone. The export is what `mlx-dspark convert` reads. Held-out
perplexity is measured before (fp32, bf16) and after, the latter from the exported bytes
dequantized by ModelOpt's own NVFP4QTensor, so it checks the files, not the fake-quant model.

    /work/venv-fx/bin/python training/export_target.py   # training/work/target_tuned_hf -> target_nvfp4
"""
import copy
import json
import shutil

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, NemotronHForCausalLM

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from common import THREADS, batch, heldout_windows, perplexity, tokens
from data import WORK
from tokenizer import TOK_DIR

SRC = WORK / "target_tuned_hf"   # step 3b's output
OUT = WORK / "target_nvfp4"
BLOCK = 16
DEMO_LABEL = ("mlx-dspark demonstration target (Nemotron-H-shaped, 3.9M parameters) trained on the "
              "Python standard library; a demonstration model, not Nemotron")


def bf16_exclusions(config):
    """Attention layers and the Mamba layer right before each one stay BF16 (NVIDIA's choice)."""
    kinds = config.layers_block_type
    keep = set()
    for i, kind in enumerate(kinds):
        if kind == "full_attention":
            keep.add(i)
            if i > 0 and kinds[i - 1] == "linear_attention":
                keep.add(i - 1)
    return sorted(keep)


def quant_cfg(config):
    cfg = copy.deepcopy(mtq.W4A16_NVFP4_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + [
        {"quantizer_name": f"*layers.{i}.*", "enable": False} for i in bf16_exclusions(config)
    ]
    return cfg


def load_bf16():
    model = NemotronHForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16).eval()
    for layer in model.model.layers:  # the router stays fp32, as in NVIDIA's checkpoints
        if layer.block_type == "moe":
            layer.mixer.gate.float()
    return model


def dequantized_state_dict(export_dir, config):
    """The exported tensors as a transformers state dict, NVFP4 layers dequantized by ModelOpt."""
    tensors = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    flat = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if name.startswith("mtp."):  # the MTP block (step 8) is no part of the transformers model
            continue
        if leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if leaf == "weight" and t.dtype == torch.uint8:
            q = NVFP4QTensor(torch.Size([t.shape[0], t.shape[1] * 2]), torch.float32, t)
            t = q.dequantize(dtype=torch.float32, scale=tensors[prefix + ".weight_scale"],
                             double_scale=tensors[prefix + ".weight_scale_2"], block_sizes={-1: BLOCK})
        flat[name] = t.float()
    sd = {k.replace("backbone.", "model.", 1): v for k, v in flat.items() if ".experts." not in k}
    for i, kind in enumerate(config.layers_block_type):
        if kind == "moe":
            for proj in ("up_proj", "down_proj"):
                sd[f"model.layers.{i}.mixer.experts.{proj}"] = torch.stack(
                    [flat[f"backbone.layers.{i}.mixer.experts.{e}.{proj}.weight"]
                     for e in range(config.n_routed_experts)])
    return sd


def load_dequantized(export_dir=None):
    """An fp32 transformers model holding exactly the exported (dequantized) weights."""
    export_dir = export_dir or OUT
    # Built from the export's own config (no quantizers: that is from_pretrained's business), so
    # recover_target.py's rebuilt export is enough to train and measure the drafter.
    model = NemotronHForCausalLM(AutoConfig.from_pretrained(export_dir)).float().eval()
    missing = model.load_state_dict(dequantized_state_dict(export_dir, model.config), strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    assert all(k.endswith("e_score_correction_bias") for k in missing.missing_keys), missing.missing_keys
    return model


def main():
    torch.set_num_threads(THREADS)
    windows = heldout_windows()
    report = {"ppl_fp32": perplexity(NemotronHForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval(), windows)}
    model = load_bf16()
    report["ppl_bf16"] = perplexity(model, windows)
    stream = tokens("train")
    calib = [batch(stream, 10_000 + i, 4, seed=99) for i in range(4)]

    def forward_loop(m):  # weight-only: activations do not matter, but ModelOpt wants a pass
        with torch.no_grad():
            for x in calib:
                m(x)

    # (ModelOpt's fake-quant forward needs CUDA; calibration and export do not.)
    mtq.quantize(model, quant_cfg(model.config), forward_loop)
    shutil.rmtree(OUT, ignore_errors=True)
    with torch.no_grad():
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=OUT)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOK_DIR / "hf" / f, OUT / f)
    config = json.loads((OUT / "config.json").read_text())
    config["mlx_dspark_demo"] = DEMO_LABEL
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    report["ppl_exported"] = perplexity(load_dequantized(), windows)
    report["bf16_layers"] = bf16_exclusions(model.config)
    report["degradation_vs_fp32"] = report["ppl_exported"] / report["ppl_fp32"] - 1
    print(json.dumps(report, indent=2))
    (WORK / "export_report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
