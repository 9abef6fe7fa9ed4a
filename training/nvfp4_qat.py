"""Quantization-aware tuning of the target: the forward sees its weights as step 4 will export them.

Found in session 15 (issue 41): a short tune from the shipped target is rounded away by the
export. After 150 steps (tune_tools.py, lr 3e-4) the fp32 model opens its thinking with a thought
(p("The") 0.64 against p("</") 0.28 after ``<think>\\n``), but its NVFP4 export closes the block
at once again (p("</") 0.81; the shipped target: 0.87): most weight updates are smaller than an
NVFP4 step. So every weight goes through the export's rounding in the forward pass here:
BF16 for all but the routers (FP32), then, for the Mamba and MoE projections outside the
layers kept in BF16 (export_target.quant_cfg), NVFP4 (a per-tensor FP32 scale
``amax / (6 * 448)``, each expert with its own, an FP8 E4M3 scale per block of 16 inputs, E2M1
values with ModelOpt's ties); the gradient passes straight through the rounding (the
straight-through estimator). ``main`` checks the rounding against a real export, tensor by tensor.

    python training/nvfp4_qat.py CKPT EXPORT_DIR   # the rounding here against EXPORT_DIR's bytes
"""
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from export_target import BLOCK, bf16_exclusions

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])   # midpoints; ties go to the even code


def bf16(w):
    return w.to(torch.bfloat16).float()


def nvfp4(w):
    """``w`` (rows x inputs) rounded as the export rounds it: BF16, then NVFP4, dequantized."""
    w = bf16(w)
    tensor_scale = w.abs().amax().clamp(min=1e-12) / (6.0 * 448.0)
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)
    block_scale = (blocks.abs().amax(-1, keepdim=True) / (6.0 * tensor_scale)).to(torch.float8_e4m3fn).float()
    scale = (block_scale * tensor_scale).clamp(min=1e-30)
    x = (blocks / scale).clamp(-6.0, 6.0)
    a = x.abs()
    code = torch.searchsorted(BOUNDS, a) + (a.unsqueeze(-1) == BOUNDS[1::2]).any(-1)
    q = E2M1[code] * x.sign()
    return (q * scale).reshape(w.shape)


def nvfp4_tensor(w):
    """A weight, or (3-D) a stack of experts, each expert with its own tensor scale."""
    return torch.stack([nvfp4(e) for e in w]) if w.dim() == 3 else nvfp4(w)


class Rounded(torch.nn.Module):
    """The export's rounding in the forward pass, the identity in the backward pass."""

    def __init__(self, rounding):
        super().__init__()
        self.rounding = rounding

    def forward(self, w):
        return w + (self.rounding(w) - w).detach()


def roundings(model):
    """(module, parameter name, rounding) for every parameter as step 4 exports it: NVFP4 for the
    Mamba and MoE projections outside the layers kept in BF16, BF16 for the rest but the
    routers, which stay FP32 (export_target.load_bf16)."""
    keep = set(bf16_exclusions(model.config))
    nvfp4_ids, routers = set(), set()
    for i, layer in enumerate(model.model.layers):
        mixer = layer.mixer
        if layer.block_type == "moe":
            routers.add(id(mixer.gate))
        if i in keep:
            continue
        if layer.block_type == "linear_attention":   # Mamba-2
            nvfp4_ids |= {id(mixer.in_proj.weight), id(mixer.out_proj.weight)}
        elif layer.block_type == "moe":
            nvfp4_ids |= {id(p) for p in (mixer.experts.up_proj, mixer.experts.down_proj,
                                          mixer.shared_experts.up_proj.weight,
                                          mixer.shared_experts.down_proj.weight)}
    return [(module, name, nvfp4_tensor if id(p) in nvfp4_ids else bf16)
            for module in model.modules() if id(module) not in routers
            for name, p in module.named_parameters(recurse=False)]


def enable(model):
    """Round every exported weight in each forward from now on (plain_state_dict() gives the
    state dict under its usual names)."""
    for module, name, rounding in roundings(model):
        parametrize.register_parametrization(module, name, Rounded(rounding))
    return model


@contextmanager
def rounded_once(model):
    """Each parameter's rounding computed once for a step, with its gradient. parametrize.cached()
    keeps the first value it computes, and one computed under no_grad (the greedy answers that
    unlikelihood and the on-policy keep loss generate before their loss) carries no gradient:
    such a step trained the two unrounded routers alone (found in session 21)."""
    with parametrize.cached():
        for module in model.modules():
            if parametrize.is_parametrized(module):
                for name in module.parametrizations:
                    getattr(module, name)
        yield


def disable(model):
    """Back to the plain model (the unrounded weights stay the parameters)."""
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
    return model


def plain_state_dict(model):
    """The model's state dict under the names load_dequantized() gives (the unrounded weights)."""
    return {k.replace("parametrizations.", "").replace(".original", ""): v
            for k, v in model.state_dict().items()}


def main():
    from export_target import dequantized_state_dict, load_dequantized
    ckpt, export = sys.argv[1], Path(sys.argv[2])
    model = load_dequantized()
    model.load_state_dict(torch.load(ckpt)["model"])
    exported = dequantized_state_dict(export, model.config)
    enable(model)
    names = list(plain_state_dict(model))
    equal = 0
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        ours = getattr(model.get_submodule(prefix), leaf).detach()   # rounded where parametrized
        same = torch.equal(ours, exported[name])
        equal += same
        if not same:
            print(f"{name}: {(ours == exported[name]).float().mean().item():.4%} of elements equal")
    print(f"{equal} of {len(names)} tensors equal to {export}'s, dequantized by ModelOpt")


if __name__ == "__main__":
    main()
