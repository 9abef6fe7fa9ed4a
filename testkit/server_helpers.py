"""What the in-process server tests share: the serve engine on a pair, started for a module's
tests (a generator for a fixture to ``yield from``), and starlette's test client on an app
made for it, its Host one the server names itself."""

from __future__ import annotations

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
