"""Step 3c: tune the target to answer chat-formatted code tasks (issue 33).

The target was trained on raw source files only, so a chat-templated prompt (what `generate`
and `chat` send by default) is text it never saw and it answers with symbol runs. This
fine-tune starts from the shipped target's exported weights (NVFP4, dequantized: step 4r) and
alternates two kinds of step, with an optional third:

  even: chat tasks (chat_data.py): the user turn and template are context, the loss is the
        next-token cross-entropy of the assistant's answer and its eos;
  odd:  plain likelihood on corpus windows, so ordinary completion keeps its perplexity;
  every --ul-every-th (0: none): sequence-level unlikelihood (tune_target.py's) on the model's own greedy answers to
        chat tasks, up to their eos: it lowers each token that completes a 4-gram already
        present, so the answers that still loop stop doing so.

Constant LR 3e-4 (tune_target.py's), fixed seeds; checkpoints every CKPT_EVERY steps and
resumes. Writes training/work/target_tuned_hf (then step 4, export_target.py, as before).

    TRAIN_THREADS=1 .venv-train/bin/python training/tune_chat.py --steps 600
"""
import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import chat_data
import nvfp4_qat
from common import THREADS, batch, resume, save_target, tokens
from data import WORK
from export_target import load_dequantized
from tune_target import repeated_ngram_mask

SEED = 9753
BATCH = 8
UL_BATCH = 4
UL_TOKENS = 128
LR = 3e-4
CKPT_EVERY = 50
CKPT = WORK / "target_chat_ckpt.pt"
OUT = WORK / "target_tuned_hf"


def chat_batch(split, step, n=BATCH):
    """Padded rows of n chat examples; labels -100 on the prompt and the padding."""
    return padded([chat_data.example(split, step * n + i) for i in range(n)])


def padded(examples):
    """(prompt ids, answer ids) pairs as padded rows; labels -100 on the prompt and the padding."""
    n = len(examples)
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), -100)
    for r, (p, a) in enumerate(examples):
        ids[r, :len(p) + len(a)] = torch.tensor(p + a)
        labels[r, len(p):len(p) + len(a)] = torch.tensor(a)
    return ids, labels


def answer_loss(model, ids, labels):
    logits = model(ids[:, :-1]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def ul_prompts(step):
    return [chat_data.example("train", 10**6 + step * UL_BATCH + i)[0] for i in range(UL_BATCH)]


def unlikelihood(model, prompts, max_tokens=UL_TOKENS):
    """-log(1 - p) at each token of the model's greedy answer that repeats a 4-gram."""
    eos = chat_data.tokenizer().eos_token_id
    model.eval()
    seqs = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no left padding for the recurrent layers
            seqs.append(model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                       pad_token_id=0, eos_token_id=eos)[0, len(p):])
    model.train()
    total, count, bad_n = torch.zeros(()), 0, 0   # a tensor even when nothing repeats
    for p, cont in zip(prompts, seqs):
        cont = cont.tolist()
        if eos in cont:
            cont = cont[:cont.index(eos) + 1]
        seq = torch.tensor([p + cont])
        bad = repeated_ngram_mask(seq, len(p))[:, 1:]
        if not bad.any():
            count += len(cont)
            continue
        prob = F.softmax(model(seq[:, :-1]).logits.float(), -1).gather(-1, seq[:, 1:, None])[..., 0]
        total = total - (torch.log((1 - prob).clamp_min(1e-5)) * bad).sum()
        count += len(cont)
        bad_n += int(bad.sum())
    return total / max(count, 1), bad_n / max(count, 1)


def tune(steps, seed, ckpt, step_loss, held_out, lr=LR, ckpt_every=CKPT_EVERY, model=None, qat=False,
         keep_every=0):
    """The tuning loop of steps 3c and 3d from the shipped target's exported weights (or from
    ``model``); ``qat``: every forward sees the weights as the export rounds them (nvfp4_qat.py);
    ``keep_every``: also keep the checkpoint of every such step as ``<ckpt stem>_<step>.pt``:
    ``step_loss(model, stream, step)`` gives (loss, repeated 4-gram share or None), every 20th
    step prints the answer loss of ``held_out()``'s batch; AdamW at constant ``lr``; checkpoints
    to ``ckpt`` every ``ckpt_every`` steps and resumes from it. Returns the model."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    stream = tokens("train")
    model = load_dequantized() if model is None else model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = resume(ckpt, model, opt)
    for group in opt.param_groups:   # a checkpoint's optimizer state brings its own lr: ours wins
        group["lr"] = lr
    if qat:
        nvfp4_qat.enable(model)
    t0 = time.time()
    while step < steps:
        with nvfp4_qat.rounded_once(model):   # the rounding once per step (qat)
            loss, rep = step_loss(model, stream, step)
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        step += 1
        if step % 20 == 1:
            with torch.no_grad():
                model.eval()
                held = answer_loss(model, *held_out()).item()
                model.train()
            print(f"step {step} loss {loss.item():.3f} held-out answer loss {held:.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        if rep is not None:
            print(f"step {step} unlikelihood {float(loss):.4f} repeated share {rep:.3f}", flush=True)
        if step % ckpt_every == 0 or step == steps:
            torch.save({"model": nvfp4_qat.plain_state_dict(model), "opt": opt.state_dict(), "step": step}, ckpt)
        if keep_every and step % keep_every == 0:
            torch.save({"model": nvfp4_qat.plain_state_dict(model), "step": step},
                       ckpt.with_name(f"{ckpt.stem}_{step}.pt"))
    return nvfp4_qat.disable(model) if qat else model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ul-every", type=int, default=0, help="every n-th step an unlikelihood one")
    args = ap.parse_args()

    def step_loss(model, stream, step):
        if args.ul_every and step % args.ul_every == args.ul_every - 1:
            return unlikelihood(model, ul_prompts(step))
        if step % 2:
            x = batch(stream, step, BATCH, SEED)
            return model(x[:, :-1], labels=x[:, :-1].clone()).loss, None
        return answer_loss(model, *chat_batch("train", step)), None

    model = tune(args.steps, SEED, CKPT, step_loss, lambda: chat_batch("heldout", 0, 16))
    save_target(model, OUT, {"chat_tune_steps": args.steps, "lr": LR, "batch": BATCH,
                             "ul_every": args.ul_every, "ul_batch": UL_BATCH, "ul_tokens": UL_TOKENS,
                             "heldout_chat_loss": answer_loss(model.eval(), *chat_batch("heldout", 0, 16)).item()})


if __name__ == "__main__":
    main()
