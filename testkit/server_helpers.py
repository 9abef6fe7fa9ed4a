"""What the in-process server tests share: the serve engine on a pair, started for a module's
tests (a generator for a fixture to ``yield from``), starlette's test client on an app made
for it, its Host one the server names itself, and the app served by uvicorn on a real socket."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn
from starlette.testclient import TestClient

from mlx_dspark import api
from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.engine import Engine


def started_engine(load=api.load, max_queue: int = 4, cache_bytes: int = 0, **options):
    """The engine on ``load()``'s pair (the demo pair by default), running until the
    fixture that yields from this ends."""
    engine = Engine(load, max_queue=max_queue, cache_bytes=cache_bytes, **options)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def app_client(engine: Engine, *args, **options) -> TestClient:
    """A test client of ``create_app(engine, *args, **options)``."""
    return TestClient(create_app(engine, *args, **options), base_url="http://localhost")


@contextlib.contextmanager
def served(engine):
    """The app on ``engine`` served by uvicorn on a thread, on a free port of 127.0.0.1: its
    base URL, until the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(create_app(engine, "demo"), lifespan="off",
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:                 # its own flag, set once it listens
        assert thread.is_alive(), "uvicorn ended before it started"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


def until(condition, seconds: float) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (checked every 10 ms): the tests'
    wait on a state another thread makes, the limit only a guard against a hang."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
