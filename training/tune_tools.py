"""Step 3d: tune the chat-tuned target to call tools, to close its thinking and not to loop
(issue 41).

Starts from the shipped target's exported weights (step 4r, dequantized) and cycles four
kinds of step:

  0, 2 (mod 4): answers: 6 tool-use examples (tool_data.py: calls, answers after a tool's
        result, thinking that ends) and 2 chat tasks (chat_data.py), loss on the reply and its
        eos, so the chat tuning of step 3c is kept;
  1:    plain likelihood on corpus windows (ordinary completion keeps its perplexity);
  3:    sequence-level unlikelihood (tune_target.py's loss) on the model's own greedy text:
        alternately its answers to chat prompts (a chat task's request, or a bare `def` line
        as `generate -p "def fibonacci(n):"` sends it) and its raw continuations of a `def`
        line (`md.generate(pair, "def is_prime(n):")`), UL_TOKENS each.

Constant LR, fixed seeds; checkpoints every CKPT_EVERY steps and resumes. Writes
training/work/target_tuned_hf (then step 4, export_target.py, as before).

    TRAIN_THREADS=1 .venv-train/bin/python training/tune_tools.py --steps 400
"""
import argparse
import random
import time

import torch

import chat_data
import tool_data
from common import THREADS, batch, resume, save_target, tokens
from data import WORK
from export_target import load_dequantized
from tune_chat import BATCH, answer_loss, padded, unlikelihood

SEED = 8642
LR = 4e-4
TOOL_SHARE = 6       # of BATCH answers per step; the rest are chat tasks
UL_BATCH = 4
UL_TOKENS = 80
CKPT_EVERY = 25
CKPT = WORK / "target_tools_ckpt.pt"
OUT = WORK / "target_tuned_hf"


def answers(split, step, n=BATCH):
    return padded([tool_data.example(split, step * n + i) if i < TOOL_SHARE * n // BATCH
                   else chat_data.example(split, 2 * 10**6 + step * n + i) for i in range(n)])


def ul_prompts(step):
    """Chat prompts (a task's request or a bare def line) on even cycles, raw def lines on odd."""
    rng = random.Random(f"{SEED}-ul-{step}")
    tok = chat_data.tokenizer()
    pool = chat_data.tasks("train")
    out = []
    for _ in range(UL_BATCH):
        name, summary, code = rng.choice(pool)
        first = code.splitlines()[0]
        if (step // 4) % 2:
            out.append(tok.encode(first, add_special_tokens=False))
        else:
            ask = chat_data.ask(name, summary, rng) if rng.random() < 0.6 else first
            out.append(tok.encode(chat_data.render([{"role": "user", "content": ask}], False),
                                  add_special_tokens=False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    stream = tokens("train")
    model = load_dequantized()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    step = resume(CKPT, model, opt)
    t0 = time.time()
    while step < args.steps:
        rep = None
        if step % 4 == 3:
            loss, rep = unlikelihood(model, ul_prompts(step), UL_TOKENS)
        elif step % 4 == 1:
            x = batch(stream, step, BATCH, SEED)
            loss = model(x[:, :-1], labels=x[:, :-1].clone()).loss
        else:
            loss = answer_loss(model, *answers("train", step))
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        step += 1
        if rep is not None:
            print(f"step {step} unlikelihood {float(loss):.4f} repeated share {rep:.3f}", flush=True)
        if step % 20 == 1:
            with torch.no_grad():
                model.eval()
                held = answer_loss(model, *answers("heldout", 0, 16)).item()
                model.train()
            print(f"step {step} loss {loss.item():.3f} held-out answer loss {held:.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        if step % CKPT_EVERY == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT)
    save_target(model, OUT, {"tool_tune_steps": step, "lr": LR, "batch": BATCH,
                             "tool_share": TOOL_SHARE, "ul_batch": UL_BATCH, "ul_tokens": UL_TOKENS,
                             "heldout_answer_loss": answer_loss(model.eval(), *answers("heldout", 0, 16)).item()})


if __name__ == "__main__":
    main()
