"""Step 3d's validation prompts for loops: choose among tune checkpoints without the held-out set.

testkit/demo_acts.py's loop bar (distinct 4-grams in 64 greedy tokens, at least 0.5 on the
worst prompt) is measured on held-out prompts; choosing a checkpoint by it would make those
prompts a training signal. Here the same measure runs on 20 requests for tasks of the corpus's
held-out split (chat_data.ask, through the chat template) and 4 of their first lines as raw
text, none of them a testkit prompt, for each converted candidate (training/candidate.sh).

    PYTHONPATH=<testkit's parent>:training $FX training/loop_validation.py training/work/cands/NAME ... [--tokens 64]
"""
import argparse
import random

import mlx_dspark as md

import chat_data
from testkit.demo_acts import LOOP_TOKENS, distinct_4grams

SEED = 2718


def prompts():
    rng = random.Random(SEED)
    tasks = rng.sample(chat_data.tasks("heldout"), 24)
    chats = [chat_data.ask(name, summary, rng) for name, summary, _ in tasks[:20]]
    raw = [code.splitlines()[0] for _, _, code in tasks[20:]]
    return chats, raw


def shares(pair, chats, raw, tokens=LOOP_TOKENS) -> list[float]:
    """The share of distinct 4-grams in ``tokens`` greedy tokens for each chat request (through
    the chat template), then for each raw prompt."""
    return [distinct_4grams(md.generate(pair, p, max_tokens=tokens, chat=True).tokens) for p in chats] + \
           [distinct_4grams(md.generate(pair, p, max_tokens=tokens, chat=False).tokens) for p in raw]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", help="folders holding target/")
    ap.add_argument("--tokens", type=int, default=LOOP_TOKENS)
    args = ap.parse_args()
    chats, raw = prompts()
    for cand in args.pairs:
        pair = md.load(f"{cand}/target", drafter=None)
        got = shares(pair, chats, raw, args.tokens)
        print(f"{cand}: worst {min(got):.3f} mean {sum(got) / len(got):.3f} "
              f"under 0.5: {sum(s < 0.5 for s in got)} of {len(got)}", flush=True)


if __name__ == "__main__":
    main()
