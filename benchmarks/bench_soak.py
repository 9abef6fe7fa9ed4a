"""The soak of issue 26 (docs/serve.md, "Memory over time"): `mlx-dspark serve` under a long
mixed workload, its resident memory sampled as it goes. Each round sends a chat completion
(a new prompt length and a new temperature every time), a completion on token ids, a stream
cut short after its first token, and bad requests (invalid JSON, a wrong type, 10k-deep
JSON). After warm-up the RSS curve should be flat: compiled graphs are bounded (short shapes
only; the drafter's draws for its last 8 sampling settings) and the prefix cache keeps to its
budget.

    python benchmarks/bench_soak.py [--rounds 400] [--every 25] [--server-flags "..."]

``--python PY --cwd DIR`` runs another checkout's server (e.g. an extracted older commit) with
the same workload."""

from __future__ import annotations

from pathlib import Path
import argparse
import json
import shlex
import subprocess
import sys
import time

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.server import launch

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near sunny beaches and pack my box with five dozen liquor jugs").split()


def rss_mb(pid: int) -> float:
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                              text=True).stdout) / 1024


def one_round(http: httpx.Client, url: str, i: int):
    n = 1 + (i * 37) % 400                    # a new prompt length (in words) most rounds
    text = " ".join(WORDS[j % len(WORDS)] for j in range(n))
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": round(0.05 + (i * 0.0137) % 1.4, 4), "seed": i}
    assert http.post(url + "/v1/chat/completions", json=chat).status_code == 200
    ids = [(i * 13 + j * 7) % 4000 + 5 for j in range(1 + (i * 11) % 300)]
    assert http.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 4,
                                                   "temperature": 0}).status_code == 200
    with http.stream("POST", url + "/v1/chat/completions",
                     json={**chat, "max_tokens": 200, "stream": True}) as r:
        next(r.iter_lines())                  # the first event, then hang up
    for body in (b"{not json", json.dumps({"messages": 5}).encode(),
                 b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"):
        status = http.post(url + "/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"}).status_code
        assert 400 <= status < 600


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--every", type=int, default=25, help="rounds between RSS samples")
    ap.add_argument("--warmup", type=int, default=50, help="rounds before the baseline")
    ap.add_argument("--server-flags", default="")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cwd", default=None)
    ap.add_argument("--json", help="write the curve here")
    args = ap.parse_args()
    if args.python != sys.executable or args.cwd:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([args.python, "-m", "mlx_dspark.cli", "serve", "--port",
                                 str(port), *shlex.split(args.server_flags)], cwd=args.cwd,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
    else:
        proc, url = launch(shlex.split(args.server_flags), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    curve = []
    try:
        # a fresh connection per request: a server that closes one after an error (an older
        # version after a 500) is not charged with the client's stale keep-alive
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            t0 = time.perf_counter()
            for i in range(args.rounds + 1):
                if i % args.every == 0:
                    curve.append((i, round(time.perf_counter() - t0, 1), rss_mb(proc.pid)))
                    print(f"round {i:5d}  {curve[-1][1]:7.1f} s  RSS {curve[-1][2]:7.1f} MB",
                          flush=True)
                if i < args.rounds:
                    one_round(http, url, i)
    finally:
        proc.terminate()
        proc.wait(30)
    base = next((rss for i, _, rss in curve if i >= args.warmup), curve[0][2])
    after = [rss for i, _, rss in curve if i >= args.warmup]
    print(f"after warm-up (round {args.warmup}): RSS {base:.1f} -> {after[-1]:.1f} MB "
          f"(max {max(after):.1f}), growth {after[-1] - base:+.1f} MB over "
          f"{args.rounds - args.warmup} rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "curve": curve}, f)


if __name__ == "__main__":
    main()
