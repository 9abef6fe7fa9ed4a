"""Step 3: train the Nemotron-H-shaped target (transformers NemotronHForCausalLM) on the corpus.

Fixed seed, AdamW, cosine schedule, fp32 on CPU. Checkpoints to training/work/target_ckpt.pt
every CKPT_EVERY steps and resumes from it; the data of step s depends only on (SEED, s), so an
interrupted run finishes identically. Writes the HF checkpoint to training/work/target_hf/.

    /work/venv-fx/bin/python training/train_target.py [--steps N]
"""
import argparse
import math
import time

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from common import THREADS, batch, resume, save_target, tokens
from data import WORK
from shapes import hf_config_kwargs

SEED = 1234
BATCH = 8
LR = 3e-3
WARMUP = 30
CKPT_EVERY = 50
CKPT = WORK / "target_ckpt.pt"
OUT = WORK / "target_hf"


def make_model():
    torch.manual_seed(SEED)
    cfg = NemotronHConfig(**hf_config_kwargs(), architectures=["NemotronHForCausalLM"],
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return NemotronHForCausalLM(cfg)


def lr_at(step, total):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total - WARMUP))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500, help="length of the LR schedule")
    ap.add_argument("--stop-at", type=int, default=None, help="end early at this checkpointed step")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    stream = tokens("train")
    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params/1e6:.2f} M parameters, {len(stream)/1e6:.2f} M training tokens")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    step = resume(CKPT, model, opt)
    model.train()
    stop = args.stop_at or args.steps
    t0, seen = time.time(), 0
    while step < stop:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps)
        x = batch(stream, step, BATCH, SEED)
        out = model(x[:, :-1], labels=x[:, :-1].clone())  # HF shifts labels internally
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        if step % 10 == 0:
            dt = time.time() - t0
            print(f"step {step} loss {out.loss.item():.3f} lr {lr_at(step, args.steps):.2e} "
                  f"{seen/dt:.0f} tok/s", flush=True)
        if step % CKPT_EVERY == 0 or step == stop:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT)
    save_target(model, OUT, {"steps": step, "schedule_steps": args.steps, "batch": BATCH})


if __name__ == "__main__":
    main()
