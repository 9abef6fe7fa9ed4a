"""mlx-dspark: Nemotron-H with NVIDIA's DSpark speculative drafter on MLX.

Public names are imported lazily so that ``mlx-dspark convert`` starts without loading MLX."""

_PUBLIC = {
    "load": "api", "generate": "api", "stream_generate": "api",
    "Pair": "api", "Result": "api", "Chunk": "api",
    "load_target": "models.nemotron_h", "load_drafter": "drafters",
    "Request": "request", "Session": "decode.session", "Stats": "stats",
}

__version__ = "0.1.0"       # pyproject.toml's version (tests/test_habits.py keeps them equal)
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        import importlib
        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'mlx_dspark' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
