"""A real ``mlx-dspark serve`` in a child process, for tests, benchmarks and scripts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])


def launch(flags=(), timeout: float = 180.0, command=("mlx_dspark.cli", "serve"),
           python: str = sys.executable, **popen):
    """Start ``mlx-dspark serve FLAGS`` in a child process on a free port of 127.0.0.1 and
    wait until it answers ``/health``; returns the process and the base URL (for tests,
    benchmarks and scripts that drive a real server). ``command``: the module (and its
    arguments) run instead, such as ``("testkit.scripted", REPLIES)`` or
    ``("mlx_lm", "server")``; ``python``: the interpreter that runs it (another checkout's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(popen.pop("env", None) or os.environ)
    if command[0].startswith("testkit."):      # it runs from this checkout, never installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [CHECKOUT, env.get("PYTHONPATH")]))
    proc = subprocess.Popen([python, "-m", *command, "--port", str(port), *flags], env=env,
                            **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{' '.join(command)} {' '.join(flags)} did not start (exit status "
                       f"{proc.wait()})")


def stop(proc, timeout: float = 15.0):
    """Terminate a launched server and wait for it (killed, and the timeout raised, if it
    does not exit in time)."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
