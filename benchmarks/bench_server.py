"""The server benchmark of issue 14 (docs/serve.md): `mlx-dspark serve` on 127.0.0.1, driven by
the `openai` client over streamed chat completions, greedy.

1. Concurrency: 1, 4 and 8 clients at once, each with its own prompt. Time to first token
   (request sent -> first text chunk) per client, and tokens/s: all clients' completion tokens
   over the wall time of the wave. The server runs one generation at a time, so with more
   clients the later ones wait: TTFT grows, aggregate tokens/s stays about one generation's.
2. A 10-turn conversation (each turn resends the whole conversation, as chat clients do),
   time to first token per turn, on a server with prefix reuse (default) and one without
   (--prefix-cache-mb 0).

    python benchmarks/bench_server.py [--model DIR --drafter DIR] [--tokens 64] [--repeats 3]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/bench_server.py
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.server import launch

TOPICS = ["read a CSV file", "parse command line arguments", "walk a directory tree",
          "retry a network call", "merge two sorted lists", "cache function results",
          "format a table", "validate an email address"]

TURNS = [f"Now write a function that can {t}, with a docstring and a short example of its "
         f"use." for t in TOPICS + ["compress a file", "count words in a text"]]


def start(flags):
    return launch(flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stream_chat(client, messages, max_tokens):
    """(time to first text, total time, text, usage) of one streamed chat completion."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    for c in client.chat.completions.create(
            model=client.model_id, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            if ch.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(ch.delta.content)
    return ttft, time.perf_counter() - t0, "".join(text), usage


def client_for(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.model_id = client.models.list().data[0].id
    return client


def concurrency(url, clients, tokens, repeats):
    client = client_for(url)
    rows = []
    for n in clients:
        waves = []
        for r in range(repeats + 1):                     # the first wave warms up
            prompts = [[{"role": "user", "content": f"Write a Python function to "
                                                    f"{TOPICS[(i + r) % len(TOPICS)]}."}]
                       for i in range(n)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                out = list(pool.map(lambda m: stream_chat(client, m, tokens), prompts))
            wall = time.perf_counter() - t0
            if r:
                waves.append((statistics.median(o[0] for o in out), max(o[0] for o in out),
                              sum(o[3].completion_tokens for o in out) / wall))
        rows.append((n, *(statistics.median(w[i] for w in waves) for i in range(3))))
    return rows


def conversation(url, tokens, repeats):
    """Per turn: prompt tokens, reused tokens, median TTFT over ``repeats`` conversations
    (each opens differently, so no conversation continues from another's snapshots)."""
    client = client_for(url)
    stream_chat(client, [{"role": "user", "content": "warm up"}], 4)
    runs = []
    for r in range(repeats):
        messages, rows = [], []
        for turn, user in enumerate(TURNS, 1):
            messages.append({"role": "user", "content": f"({r}) {user}" if turn == 1 else user})
            ttft, _, text, usage = stream_chat(client, messages, tokens)
            rows.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, ttft))
            messages.append({"role": "assistant", "content": text})
        runs.append(rows)
    return [(turn, *runs[0][turn - 1][:2], statistics.median(run[turn - 1][2] for run in runs))
            for turn in range(1, len(TURNS) + 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", metavar="DIR")
    ap.add_argument("--drafter", metavar="DIR")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--turn-tokens", type=int, default=48,
                    help="tokens per conversation answer (default 48)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="waves per client count, and conversations per server (median)")
    args = ap.parse_args()
    flags = [f for k in ("model", "drafter") if getattr(args, k)
             for f in (f"--{k}", getattr(args, k))]

    proc, url = start(flags)
    try:
        waves = concurrency(url, (1, 4, 8), args.tokens, args.repeats)
        reuse = conversation(url, args.turn_tokens, args.repeats)
    finally:
        proc.terminate()
        proc.wait()
    proc, url = start(flags + ["--prefix-cache-mb", "0"])
    try:
        cold = conversation(url, args.turn_tokens, args.repeats)
    finally:
        proc.terminate()
        proc.wait()

    print(f"\n{args.tokens} tokens per answer, greedy, median of {args.repeats} waves\n")
    print("| clients | TTFT median (s) | TTFT max (s) | tokens/s (all clients) |")
    print("|---:|---:|---:|---:|")
    for n, med, worst, tps in waves:
        print(f"| {n} | {med:.3f} | {worst:.3f} | {tps:.1f} |")
    print(f"\n10-turn conversation, {args.turn_tokens} tokens per answer, median of "
          f"{args.repeats} conversations\n")
    print("| turn | prompt tokens | reused (cached) | TTFT reuse on (s) | TTFT reuse off (s) |")
    print("|---:|---:|---:|---:|---:|")
    for (turn, prompt, cached, on), (_, prompt_off, _, off) in zip(reuse, cold):
        flag = "" if prompt == prompt_off else " (prompts differ)"
        print(f"| {turn} | {prompt} | {cached} | {on:.3f} | {off:.3f}{flag} |")
    total_on, total_off = sum(r[3] for r in reuse), sum(r[3] for r in cold)
    print(f"\nsum of TTFT over the 10 turns: reuse on {total_on:.3f} s, off {total_off:.3f} s")


if __name__ == "__main__":
    main()
