"""Step 3b: unlearn greedy loops (sequence-level unlikelihood, Welleck et al. 2019, §5.2).

A model this small trained by maximum likelihood alone falls into loops under greedy decoding
(`'x', 'x', 'x'`, `1, 1, 1`): the longer it repeats, the likelier the repeat looks to it. This
fine-tune shows the model its own greedy continuations and lowers the probability of each token
that completes a 4-gram already present earlier in the text; every other step is a plain
likelihood step on the corpus, so it keeps modelling Python. The result is still a plain
NemotronHForCausalLM: greedy decoding, speculative or not, is unchanged, only the weights are.

Odd steps: BATCH corpus prefixes of PREFIX tokens, continued greedily for CONT tokens (no
gradient); loss = ALPHA * mean over continuation positions of  -log(1 - p(x_t | x_<t)) * [the
4-gram ending at t occurred before].  Even steps: next-token cross-entropy on corpus windows.
Constant LR (the end of step 3's schedule), fixed seeds, checkpoints every CKPT_EVERY steps and
resumes like step 3. Reads training/work/target_hf, writes training/work/target_tuned_hf.

    /work/venv-fx/bin/python training/tune_target.py [--steps N]
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import NemotronHForCausalLM

from common import THREADS, batch, resume, save_target, tokens
from data import WORK

SEED = 2468
BATCH = 8
PREFIX = 64
CONT = 128
GRAM = 4
LR = 3e-4
ALPHA = 1.0      # weight of the unlikelihood term (the paper's; 4.0 was no better, README)
CKPT_EVERY = 50
SRC = WORK / "target_hf"
CKPT = WORK / "target_tune_ckpt.pt"
OUT = WORK / "target_tuned_hf"


def repeated_ngram_mask(seq: torch.Tensor, start: int, n: int = GRAM) -> torch.Tensor:
    """[B, L] bool: positions t >= start whose n-gram ending at t occurred earlier in the row."""
    mask = torch.zeros(seq.shape, dtype=torch.bool)
    for b, row in enumerate(seq.tolist()):
        seen = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1:t + 1])
            if gram in seen and t >= start:
                mask[b, t] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(model, stream, step):
    g = np.random.default_rng([SEED, step])
    starts = g.integers(0, len(stream) - PREFIX, size=BATCH)
    prefix = torch.from_numpy(np.stack([stream[s:s + PREFIX] for s in starts]))
    model.eval()
    with torch.no_grad():
        seq = model.generate(prefix, max_new_tokens=CONT, min_new_tokens=CONT, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    model.train()
    logits = model(seq[:, :-1]).logits.float()
    target = seq[:, 1:]
    p = F.softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    bad = repeated_ngram_mask(seq, PREFIX)[:, 1:]
    loss = -ALPHA * (torch.log((1 - p).clamp_min(1e-5)) * bad).sum() / (BATCH * CONT)
    return loss, bad.float().sum().item() / (BATCH * CONT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    stream = tokens("train")
    model = NemotronHForCausalLM.from_pretrained(SRC, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    step = resume(CKPT, model, opt)
    model.train()
    t0 = time.time()
    while step < args.steps:
        if step % 2:
            loss, rep = unlikelihood_loss(model, stream, step)
        else:
            x = batch(stream, step, BATCH, SEED)
            loss, rep = model(x[:, :-1], labels=x[:, :-1].clone()).loss, None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if rep is not None and step % 10 == 0:
            print(f"step {step} unlikelihood {loss.item():.4f} repeated 4-gram share of its "
                  f"continuations {rep:.3f} ({time.time() - t0:.0f} s)", flush=True)
        if step % CKPT_EVERY == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT)
    save_target(model, OUT, {"tune_steps": step, "alpha": ALPHA, "batch": BATCH, "prefix": PREFIX,
                             "continuation": CONT, "lr": LR})


if __name__ == "__main__":
    main()
