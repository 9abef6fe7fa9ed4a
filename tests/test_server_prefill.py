"""A long prompt on a real ``mlx-dspark serve`` (issue 30 item 5, issue 33 item 2): its prefill
goes in pieces of about 512 tokens, ``/health`` shows how far it is and the log has a line
per piece once it has taken a second; a client that leaves stops it within one piece, and SIGTERM ends the process within
seconds. Measured against the prompt's own prefill time: without the per-piece check the
engine ran on to the next checkpoint (4096 tokens, many seconds here)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

from mlx_dspark.decode.pieces import PIECE
from mlx_dspark.serve.engine import LOG_AFTER
from testkit.server import launch, stop

pytestmark = pytest.mark.slow          # server processes

LONG = 8000        # tokens: tens of seconds of prefill on 2 cores, past the 4096 checkpoint


def _start():
    return launch(["--speculative", "off"], stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _health(url):
    return httpx.get(url + "/health", timeout=5).json()


def _long_prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 1000, LONG).tolist()


def _send(url, prompt, stream: bool) -> socket.socket:
    """Post a completion of ``prompt`` on a socket of its own, left open (closing it is the
    client leaving, whether or not the answer streams)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "stream": stream}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _wait(url, until, timeout: float) -> tuple[dict, float]:
    """Poll /health until ``until(health)``; returns it and when (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _health(url)
        if until(health):
            return health, time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"/health never got there: {health}")


def _in_prefill(health) -> bool:
    p = health["prefill"]
    return p is not None and PIECE <= p["done"] < p["total"]


@pytest.fixture(scope="module")
def server():
    proc, url = _start()
    log = []            # the server's output, read as it comes (a pipe left unread fills)
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    yield url, log
    stop(proc)
    reader.join(30)
    out = b"".join(log).decode()
    assert "Traceback" not in out, out[-3000:]


def test_the_log_has_a_line_for_each_piece_once_a_prefill_has_taken_a_second(server):
    url, log = server
    before = _health(url)
    sock = _send(url, _long_prompt(3), True)
    # /health's numbers come from the same progress call that logs, so a piece reported
    # past LOG_AFTER seconds has its line (a prefill under a second logs none, by design)
    health, _ = _wait(url, lambda h: _in_prefill(h)
                      and h["prefill"]["seconds"] > LOG_AFTER + 0.01, 60)
    sock.close()
    _wait(url, lambda h: h["cancelled"] > before["cancelled"] and h["prefill"] is None, 60)
    line = f"prefill {health['prefill']['done']}/{LONG} tokens, "
    out = b"".join(log).decode()
    assert any(line in row and "tokens/s, about" in row and "s left" in row
               for row in out.splitlines()), out[-3000:]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_a_long_prefill_frees_the_engine_within_one_piece(server, stream):
    server, _ = server
    before = _health(server)
    assert before["prefill"] is None                     # nothing running
    sock = _send(server, _long_prompt(int(stream)), stream)
    health, _ = _wait(server, _in_prefill, 60)
    assert health["prefill"]["total"] == LONG            # /health shows the running prefill
    rate = health["prefill"]["done"] / health["prefill"]["seconds"]
    sock.close()                                         # the client leaves
    left = time.monotonic()
    health, free = _wait(server, lambda h: h["cancelled"] > before["cancelled"]
                         and h["prefill"] is None, 60)
    took = free - left
    # within about a piece (its time at the rate measured, plus polling and slack for a
    # loaded machine), far from what the rest of the prompt up to its checkpoint would take
    assert took < max(3.0, 3 * PIECE / rate), (took, rate)
    assert took < (4096 - PIECE) / rate / 2, (took, rate)
    assert health["served"] == before["served"]


def test_sigterm_during_a_long_prefill_ends_the_server_within_seconds():
    proc, url = _start()
    try:
        sock = _send(url, _long_prompt(7), True)
        health, _ = _wait(url, _in_prefill, 60)
        rate = health["prefill"]["done"] / health["prefill"]["seconds"]
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        status = proc.wait(30)
        took = time.monotonic() - t0
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert status == -signal.SIGTERM
    assert took < max(4.0, 3 * PIECE / rate), (took, rate)
    assert b"the server is shutting down" in answer, answer       # the stream was told
    assert "Traceback" not in proc.stdout.read().decode()
