"""Issue 41 experiment: a second attention layer before the one that chooses the tool.

Builds the target with a new attention layer at ``--insert`` (default 2: ``MEM*EM`` becomes
``ME*M*EM``, the old layers 0-5 at 0, 1, 3, 4, 5, 6) from a tune checkpoint, the new layer initialised at
random except ``o_proj`` = 0 (the model's function is unchanged at step 0), then runs
tune_tools.py on it with the remaining arguments (CARRY_LAYER moved to the old attention).

    PYTHONPATH=training TRAIN_THREADS=1 $FX training/grow_attention.py --from CKPT -- --hard ...
"""
import argparse
import sys

import torch
from transformers import NemotronHForCausalLM

import tune_tools
from export_target import load_dequantized


def grown(state, old_model, insert):
    """The model of ``state`` with a new attention layer at index ``insert`` (the old layers
    from there on move up one), its ``o_proj`` zero so the function is unchanged."""
    old = old_model.config.hybrid_override_pattern
    old = old if isinstance(old, str) else "".join(old)
    pattern = old[:insert] + "*" + old[insert:]
    cfg = old_model.config.to_dict()
    cfg.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern), layers_block_type=None)
    model = NemotronHForCausalLM(type(old_model.config)(**cfg)).float()
    new = model.state_dict()
    where = {j: j + (j >= insert) for j in range(len(old))}
    for k, v in state.items():
        if k.startswith("model.layers."):
            i, rest = k.split(".", 3)[2:]
            k = f"model.layers.{where[int(i)]}.{rest}"
        assert new[k].shape == v.shape, k
        new[k] = v
    new[f"model.layers.{insert}.mixer.o_proj.weight"].zero_()
    model.load_state_dict(new)
    print(f"grown {old} -> {pattern}: old layers at {where}", flush=True)
    return model, where


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", required=True)
    ap.add_argument("--insert", type=int, default=2, help="the new attention layer's index")
    args, rest = ap.parse_known_args()
    base = load_dequantized()
    model, where = grown(torch.load(args.src)["model"], base, args.insert)
    tune_tools.CARRY_LAYER = where[3]
    sys.argv = [sys.argv[0]] + [a for a in rest if a != "--"]
    tune_tools.main(model)


if __name__ == "__main__":
    main()
