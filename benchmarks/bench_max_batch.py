"""``serve --max-batch``'s default: aggregate tokens/s of 8 concurrent requests through the
serve engine (serve/engine.py, serve/batching.py) at --max-batch 1, 2, 4 and 8, in one run.
Demo pair, greedy, 8 distinct prompts, no stop tokens (every request generates ``--tokens``),
the server's --speculative modes; the clock runs from the first submit to the last chunk
(prefills included). Repeats are interleaved; medians, and each one's ratio to --max-batch 1.

    python benchmarks/bench_max_batch.py [--tokens 48] [--repeats 3] [--modes auto off on]
"""

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time

import mlx_dspark as md
from mlx_dspark import api
from mlx_dspark.serve.engine import Engine, Job

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
           "class Stack:\n    def __init__(self):", "def quicksort(xs):", "The quick brown fox",
           "for i in range(10):", "SELECT name FROM", "# A small web server\n"]
SIZES = (1, 2, 4, 8)


def aggregate(engine, requests) -> float:
    """Tokens per second of ``requests`` submitted together to ``engine``."""
    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job(r, loop) for r in requests]
        t0 = time.perf_counter()
        for job in jobs:
            engine.submit(job)
        generated = 0
        for job in jobs:
            while True:
                kind, item = await job.out.get()
                if kind == "error":
                    raise RuntimeError(item)
                if kind == "chunk" and item.finish_reason is not None:
                    generated += item.stats.generated
                    break
        return generated / (time.perf_counter() - t0)
    return asyncio.run(run())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["auto", "off", "on"])
    args = p.parse_args()
    pair = md.load()
    engines = {n: Engine(lambda: pair, max_queue=len(PROMPTS), cache_bytes=0, max_batch=n)
               for n in SIZES}
    for engine in engines.values():
        engine.start()
    try:
        for mode in args.modes:
            requests = [dataclasses.replace(api.make_request(pair, prompt, args.tokens,
                                                             temperature=0, speculative=mode),
                                            stop_tokens=frozenset()) for prompt in PROMPTS]
            aggregate(engines[SIZES[-1]], requests)            # warm every shape once
            rates = {n: [] for n in SIZES}
            for _ in range(args.repeats):
                for n in SIZES:
                    rates[n].append(aggregate(engines[n], requests))
            base = statistics.median(rates[1])
            for n in SIZES:
                med = statistics.median(rates[n])
                print(f"speculative {mode:4}  --max-batch {n}: {med:6.1f} tokens/s "
                      f"({med / base:.2f}x; runs {', '.join(f'{r:.1f}' for r in rates[n])})",
                      flush=True)
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)     # (the interpreter's own exit can abort after the engine threads)
