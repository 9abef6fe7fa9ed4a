"""Step 3d: tune the chat-tuned target to call tools, to close its thinking and not to loop
(issue 41).

Starts from the shipped target's exported weights (step 4r, dequantized) and cycles four
kinds of step:

  0, 1, 2 (mod 4): answers: 6 tool-use examples (tool_data.py: calls, answers after a tool's
        result, thinking that ends) and 2 chat tasks (chat_data.py), loss on the reply and its
        eos, so the chat tuning of step 3c is kept;
  3, 11 (mod 8): plain likelihood on corpus windows (ordinary completion keeps its perplexity);
  7 (mod 8): sequence-level unlikelihood (tune_target.py's loss) on the model's own greedy text:
        alternately its answers to chat prompts (a chat task's request, or a bare `def` line
        as `generate -p "def fibonacci(n):"` sends it) and its raw continuations of a `def`
        line (`md.generate(pair, "def is_prime(n):")`), UL_TOKENS each.

The first FIRST steps ran an earlier schedule (answers on 0 and 2 mod 4, corpus on 1, unlikelihood
on 3) with tool_data.py's first, smaller name lists (commit a1e4418): at step 150 the model
still wrote training names instead of copying the offered ones, so names became verb-noun
compositions and answers took three steps in four. Constant LR, fixed seeds; checkpoints every CKPT_EVERY steps and resumes. Writes
training/work/target_tuned_hf (then step 4, export_target.py, as before).

    TRAIN_THREADS=1 .venv-train/bin/python training/tune_tools.py --steps 400
"""
import argparse
import random


import chat_data
import tool_data
from common import batch, save_target
from data import WORK
from tune_chat import BATCH, answer_loss, padded, tune, unlikelihood

SEED = 8642
LR = 4e-4
FIRST = 150      # steps run with the first schedule and tool_data.py (commit a1e4418; README)
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
        if (step // (4 if step < FIRST else 8)) % 2:
            out.append(tok.encode(first, add_special_tokens=False))
        else:
            ask = chat_data.ask(name, summary, rng) if rng.random() < 0.6 else first
            out.append(tok.encode(chat_data.render([{"role": "user", "content": ask}], False),
                                  add_special_tokens=False))
    return out


def kind(step):
    if step < FIRST:
        return {1: "corpus", 3: "ul"}.get(step % 4, "answers")
    return "ul" if step % 8 == 7 else "corpus" if step % 4 == 3 else "answers"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--random-names", action="store_true",
                    help="generated tools get meaningless names (tool_data.RANDOM_NAMES)")
    args = ap.parse_args()
    tool_data.RANDOM_NAMES = args.random_names

    def step_loss(model, stream, step):
        if kind(step) == "ul":
            return unlikelihood(model, ul_prompts(step), UL_TOKENS)
        if kind(step) == "corpus":
            x = batch(stream, step, BATCH, SEED)
            return model(x[:, :-1], labels=x[:, :-1].clone()).loss, None
        return answer_loss(model, *answers("train", step)), None

    model = tune(args.steps, SEED, CKPT, step_loss, lambda: answers("heldout", 0, 16), LR, CKPT_EVERY)
    save_target(model, OUT, {"tool_tune_steps": args.steps, "lr": LR, "batch": BATCH,
                             "tool_share": TOOL_SHARE, "ul_batch": UL_BATCH, "ul_tokens": UL_TOKENS,
                             "heldout_answer_loss": answer_loss(model.eval(), *answers("heldout", 0, 16)).item()})


if __name__ == "__main__":
    main()
