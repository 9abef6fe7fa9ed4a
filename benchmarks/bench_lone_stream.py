"""What a lone request pays for going through the engine's batch: two ``mlx-dspark serve``
processes, ``--max-batch 1`` and ``--max-batch N``, sent one streamed greedy completion at a
time, alternately, so load swings fall on both; medians of the request times and their ratio.

    python benchmarks/bench_lone_stream.py [--max-batch 8] [--tokens 64] [--repeats 12]
                                           [--speculative off]
"""

import sys
from pathlib import Path
import argparse
import json
import statistics
import subprocess
import time

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.server import launch, stop

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def request(url: str, prompt: str, tokens: int) -> float:
    """Seconds from sending one streamed completion to its last event."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, generated = time.perf_counter(), 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                generated = usage["completion_tokens"]
    if not generated:
        raise RuntimeError(f"{url}: no completion tokens came back")
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--speculative", default="off", choices=["off", "on", "auto"])
    args = p.parse_args()
    sizes = (1, args.max_batch)
    servers = {n: launch(["--max-batch", str(n), "--speculative", args.speculative],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
               for n in sizes}
    try:
        times = {n: [] for n in sizes}
        for n in sizes:                                   # warm-up
            request(servers[n][1], PROMPTS[0], args.tokens)
        for i in range(args.repeats):
            for n in sizes:
                times[n].append(request(servers[n][1], PROMPTS[i % len(PROMPTS)], args.tokens))
        med = {n: statistics.median(t) for n, t in times.items()}
        for n in sizes:
            print(f"--max-batch {n}: {med[n]:.3f} s per request (median of {args.repeats})")
        print(f"--max-batch {args.max_batch} / --max-batch 1: "
              f"{med[args.max_batch] / med[1]:.2f}x the time")
    finally:
        for proc, _ in servers.values():
            stop(proc)


if __name__ == "__main__":
    main()
