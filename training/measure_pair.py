"""Step 7: acceptance of the shipped (converted) pair in the MLX runtime, on training/prompts.json.

Greedy and sampled (temperature 1.0, top-p 0.95) speculation forced on, N = 3; pooled over all
prompts: mean tokens per round (bonus included) and conditional acceptance by position; the chat
prompts go through the chat template. Then how much the target repeats itself: the share of
distinct 4-grams in 128 greedy tokens on each of `mlx-dspark bench`'s code prompts (windows of
real stdlib code score about 0.9); and whether its greedy answers to the held-out chat prompts
read as code: distinct 4-grams and the share of letters, digits and whitespace in 128 tokens
(issue 33 asks for at least 0.5 and 0.6).
Speed comparisons are `mlx-dspark bench`'s job; this only counts. Runtime venv:

    /work/venv/bin/python training/measure_pair.py [--max-tokens 64] [--pair DIR | --drafter mtp]
"""
import argparse
import json
from pathlib import Path

import mlx_dspark as md
from mlx_dspark.cli.bench import PROMPTS as BENCH_PROMPTS

PROMPTS = json.loads((Path(__file__).parent / "prompts.json").read_text())


def pooled(pair, prompts, max_tokens, **sampling):
    rounds = tokens = 0
    tested, accepted = [0, 0, 0], [0, 0, 0]
    for i, prompt in enumerate(prompts):
        s = md.generate(pair, prompt, max_tokens=max_tokens, speculative=True, num_draft=3,
                        seed=i, **sampling).stats
        rounds += s["rounds"]
        tokens += s["mean_tokens_per_round"] * s["rounds"]
        for j in range(3):
            tested[j] += s["tested_by_position"][j]
            accepted[j] += round(s["acceptance_by_position"][j] * s["tested_by_position"][j]) if s["tested_by_position"][j] else 0
    return {"rounds": rounds, "mean_tokens_per_round": round(tokens / rounds, 3),
            "acceptance_by_position": [round(a / t, 3) if t else None for a, t in zip(accepted, tested)]}


def distinct_4grams(tokens) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams)


def wordlike(text: str) -> float:
    """Share of characters that are letters, digits or whitespace (symbol runs score low)."""
    return sum(c.isalnum() or c.isspace() for c in text) / max(len(text), 1)


def chat_answers(pair, prompts, max_tokens=128):
    """Greedy answers to chat prompts (through the chat template, as `chat` sends them): per
    prompt, the distinct 4-gram share of its tokens and the word-like share of its text."""
    runs = [md.generate(pair, p, max_tokens=max_tokens, chat=True) for p in prompts]
    each = [[round(distinct_4grams(r.tokens), 3), round(wordlike(r.text), 3), len(r.tokens)]
            for r in runs]
    return {"worst_distinct_4grams": min(e[0] for e in each),
            "worst_wordlike": min(e[1] for e in each), "each_4grams_wordlike_tokens": each}


def greedy_runs(pair, prompts, max_tokens=128):
    """One greedy speculative run (N = 3) per prompt: its tokens are the serial greedy tokens
    (greedy speculation is lossless), so one run serves both repetition measures."""
    return [md.generate(pair, p, max_tokens=max_tokens, speculative=True, num_draft=3) for p in prompts]


def repetition(runs):
    shares = [distinct_4grams(r.tokens) for r in runs]
    return {"mean": round(sum(shares) / len(shares), 3), "worst": round(min(shares), 3),
            "each": [round(x, 3) for x in shares]}


def by_repetition(runs, moves_on=0.7):
    """Tokens per round pooled separately over prompts whose output moves on (distinct 4-gram
    share >= moves_on) and over those that loop: a drafter predicts a loop easily, so only the
    first group compares drafters across targets that loop differently."""
    groups = {"moves_on": [0, 0, 0.0], "loops": [0, 0, 0.0]}   # prompts, rounds, tokens
    each = []
    for r in runs:
        share, rounds, per_round = distinct_4grams(r.tokens), r.stats["rounds"], r.stats["mean_tokens_per_round"]
        g = groups["moves_on" if share >= moves_on else "loops"]
        g[0], g[1], g[2] = g[0] + 1, g[1] + rounds, g[2] + per_round * rounds
        each.append([round(share, 3), round(per_round, 2)])
    return {name: {"prompts": n, "mean_tokens_per_round": round(t / k, 3) if k else None}
            for name, (n, k, t) in groups.items()} | {"each_share_tokens_per_round": each}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pair", metavar="DIR", help="a folder holding target/ and drafter/ "
                    "(default: the embedded demo pair), e.g. an earlier pair from git history")
    ap.add_argument("--drafter", default="dspark", metavar="NAME",
                    help="which embedded demo drafter (dspark, mtp): tokens per round only")
    args = ap.parse_args()
    pair = md.load(f"{args.pair}/target", f"{args.pair}/drafter") if args.pair else \
        md.load(drafter=args.drafter)
    report = {}
    for name, sampling in (("greedy", {}), ("t1.0_p0.95", {"temperature": 1.0, "top_p": 0.95})):
        for group in ("code", "text", "chat"):
            report[f"{name}/{group}"] = pooled(pair, PROMPTS[group], args.max_tokens,
                                               chat=group == "chat", **sampling)
            print(f"{name}/{group}", json.dumps(report[f"{name}/{group}"]), flush=True)
    if args.drafter != "dspark":
        return
    code = list(dict.fromkeys(BENCH_PROMPTS["code"] + PROMPTS["code"]))  # the bench's first
    runs = greedy_runs(pair, code)
    report["distinct_4grams/bench_code"] = repetition(runs[:len(BENCH_PROMPTS["code"])])
    print("distinct_4grams/bench_code", json.dumps(report["distinct_4grams/bench_code"]))
    report["greedy_by_repetition/code"] = by_repetition(runs)
    print("greedy_by_repetition/code", json.dumps(report["greedy_by_repetition/code"]))
    report["chat_answers"] = chat_answers(pair, PROMPTS["chat"])
    print("chat_answers", json.dumps(report["chat_answers"]))


if __name__ == "__main__":
    main()
