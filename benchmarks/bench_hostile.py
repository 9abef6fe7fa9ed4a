"""Hostile clients against `mlx-dspark serve` (issue 26; docs/serve.md, "Connections").

1. Slow connections: N sockets each send half a request header and then nothing; while they
   are open, legitimate chat requests are timed (a server without a time to send a request,
   or out of file descriptors, never answers them). Then: how many of the slow ones the
   server has closed after --read-timeout.
2. Huge bodies: 100 MB chat bodies sent whole (chunked, no Content-Length) and announced by
   Content-Length; the answer's status and time, and the server's RSS after each.

    python benchmarks/bench_hostile.py [--slow 3000] [--legit 5]
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import json
import resource
import socket
import statistics
import subprocess
import time

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.server import launch

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def rss_mb(pid: int) -> float:
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                              text=True).stdout) / 1024


def slow_connections(url: str, n: int, legit: int, read_timeout: float):
    port = int(url.rsplit(":", 1)[1])
    socks = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = socket.socket()
        s.setblocking(True)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: local")
            socks.append(s)
        except OSError:
            s.close()
    opened = time.perf_counter() - t0
    times = []
    for _ in range(legit):
        t = time.perf_counter()
        r = httpx.post(url + CHAT, json=HI, timeout=60)
        times.append((time.perf_counter() - t, r.status_code))
    time.sleep(read_timeout + 2)
    closed = 0
    for s in socks:
        s.settimeout(0.01)
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except (socket.timeout, BlockingIOError):
            pass
        s.close()
    print(f"{len(socks)} slow connections opened in {opened:.1f} s; legitimate requests: "
          f"median {statistics.median(t for t, _ in times) * 1000:.0f} ms, "
          f"max {max(t for t, _ in times) * 1000:.0f} ms, statuses "
          f"{sorted({c for _, c in times})}; {closed} of {len(socks)} slow ones closed by the "
          f"server {read_timeout + 2:.0f} s later")


def huge_bodies(url: str, pid: int, mb: int):
    payload = json.dumps({"messages": [{"role": "user", "content": "x" * (mb << 20)}]}).encode()
    print(f"RSS before: {rss_mb(pid):.0f} MB")
    for how in ("chunked", "content-length"):
        t = time.perf_counter()
        if how == "chunked":
            chunks = (payload[i:i + (1 << 20)] for i in range(0, len(payload), 1 << 20))
            try:
                status = httpx.post(url + CHAT, content=chunks, timeout=120, headers={
                    "Content-Type": "application/json"}).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
        else:
            status = httpx.post(url + CHAT, content=payload, timeout=120, headers={
                "Content-Type": "application/json"}).status_code
        print(f"{mb} MB body ({how}): {status} in {time.perf_counter() - t:.2f} s; server RSS "
              f"{rss_mb(pid):.0f} MB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=int, default=3000)
    ap.add_argument("--legit", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--read-timeout", type=int, default=10)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # this client needs a socket each
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.slow + 256)), hard))
    proc, url = launch(("--read-timeout", str(args.read_timeout)), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        slow_connections(url, args.slow, args.legit, args.read_timeout)
        huge_bodies(url, proc.pid, args.mb)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
