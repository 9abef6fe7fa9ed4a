"""Tried in step 3d (issue 41, session 21; not shipped): a tuned target without its loops, by
self-distillation in which the teacher is the starting checkpoint itself, frozen, with the tokens
that would repeat a 4-gram a third time masked out. Measured (training/README.md, step 3d): it
does not lower the validation loop rate (3 to 8 of 48 from a start at 3); a trained unlikelihood
step every second step does.

Step 3d's tunes move which prompts loop, not how many (3 to 8 of select_checks.py's 48, README).
Unlikelihood pushes a looping token down but does not say where its mass should go, and the keep
loss's teacher (the shipped target) loops as often as its students. Here every step the model
answers KEEP prompts of the kinds the bars measure (tune_tools.keep_prompts: chat requests with
thinking off and on, raw def lines, tool requests' thoughts), greedily with third repeats barred,
and learns KL(teacher || model) on that text with the same tokens masked in the teacher
(tune_tools.keep_loss, on policy, ``deloop``). Where the start would not loop, its target is
itself and nothing moves; where it would, the target is its own next choice.

    cd /tmp && PYTHONPATH=<testkit's parent>:<repo>/training TRAIN_THREADS=1 $FX <repo>/training/deloop.py \\
        --init training/work/NAME.pt --ckpt training/work/OUT.pt --steps 60 --keep-every 10
"""
import argparse
from pathlib import Path

import torch

import nvfp4_qat
from export_target import load_dequantized
from tune_chat import tune
from tune_tools import KEEP_TOKENS, answers, keep_loss, keep_prompts

SEED = 1357
KEEP = 4


def weights(init):
    model = load_dequantized()
    model.load_state_dict(torch.load(init)["model"])
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True, help="a tune_tools.py checkpoint (.pt): the start and the teacher")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--keep", type=int, default=KEEP, help="prompts a step")
    ap.add_argument("--keep-every", type=int, default=10)
    args = ap.parse_args()
    teacher = nvfp4_qat.enable(weights(args.init)).eval()   # as the export rounds it: every tune ran --qat
    for p in teacher.parameters():
        p.requires_grad_(False)

    def step_loss(model, stream, step):
        prompts = keep_prompts(10**6 + step, args.keep)   # not the keep prompts step 3d saw
        return keep_loss(model, teacher, prompts, KEEP_TOKENS, on_policy=True, deloop=True), None

    tune(args.steps, SEED, Path(args.ckpt), step_loss, lambda: answers("heldout", 0, 16), args.lr,
         args.keep_every, weights(args.init), qat=True, keep_every=args.keep_every)


if __name__ == "__main__":
    main()
