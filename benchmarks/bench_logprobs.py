"""What ``logprobs`` cost on the server: the same chat request with and without
``logprobs: true, top_logprobs: 3``, on the in-process app (the demo pair), alternated,
median of the repeats; prints the ratio (ARCHITECTURE.md, serve/logprobs.py).

    python benchmarks/bench_logprobs.py [--repeats 7] [--max-tokens 64] [--speculative on]"""

from __future__ import annotations

import argparse
import statistics
import time

from starlette.testclient import TestClient

from mlx_dspark import api
from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.engine import Engine

PROMPT = [{"role": "system", "content": "You write Python. " * 40},
          {"role": "user", "content": "def parse_args(argv):"}]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speculative", default="auto")
    args = p.parse_args(argv)
    engine = Engine(api.load, max_queue=4, cache_bytes=0)
    engine.start()
    client = TestClient(create_app(engine, "demo", defaults={"speculative": args.speculative}),
                        base_url="http://localhost")
    body = {"messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    times = {"plain": [], "logprobs": []}
    try:
        for i in range(args.repeats + 1):           # the first pair warms up
            for kind, extra in (("plain", {}), ("logprobs", {"logprobs": True,
                                                             "top_logprobs": 3})):
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json={**body, **extra})
                assert r.status_code == 200, r.text
                if i:
                    times[kind].append(time.perf_counter() - t0)
    finally:
        engine.stop()
    plain, scored = (statistics.median(times[k]) for k in ("plain", "logprobs"))
    ratios = sorted(b / a for a, b in zip(times["plain"], times["logprobs"]))
    print(f"median request: {plain * 1e3:.0f} ms plain, {scored * 1e3:.0f} ms with logprobs; "
          f"ratio {scored / plain:.2f}x (paired per repeat: {ratios[0]:.2f}-{ratios[-1]:.2f}, "
          f"{args.repeats} repeats, {args.max_tokens} tokens, speculative {args.speculative})")


if __name__ == "__main__":
    main()
