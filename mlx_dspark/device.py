"""What the device that runs decides: whether MLX computes on a GPU, the dtype a scaled
matmul accumulates in, and the housekeeping around a generation (as mlx-lm's generate.py
does it). Below the models and the memory pre-flight, which both follow it."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

import mlx.core as mx


def on_gpu() -> bool:
    """Whether MLX computes on a GPU by default (Metal, or any other GPU backend MLX has):
    dtype and kernel choices follow the device that runs, not the platform."""
    return mx.default_device().type == mx.DeviceType.gpu


def accumulation_dtype(dtype):
    """The dtype a scaled matmul computes in for activations of ``dtype``: float32 for
    float16 (the unscaled product overflows it), else ``dtype``."""
    return mx.float32 if dtype == mx.float16 else dtype


# ---------------------------------------------------------------------------------------------
# Housekeeping around a generation: a stream of its own, the wired-memory limit, and the
# allocator's cache cleared now and then. Each is a no-op where the backend has none.

CLEAR_EVERY = 256
"""Tokens between two ``mx.clear_cache()`` calls (the first right after the prefill)."""

_streams: dict = {}


def generation_stream() -> mx.ThreadLocalStream:
    """The stream generation computes on, on the default device. One per thread, as
    mlx-lm's: an MLX stream belongs to the thread that made it, and the server's engine
    decodes on a thread of its own."""
    device = mx.default_device()
    key = str(device)                 # (a Device hashes by identity)
    if key not in _streams:
        _streams[key] = mx.new_thread_local_stream(device)
    return _streams[key]


def release_streams():
    """Destroy the streams this thread made (:func:`generation_stream`'s share of it
    included). MLX asks this of every thread that ran work on a stream, before it ends: a
    stream that outlives its thread is torn down at the process's exit, and there it aborted
    one process in two on the CPU backend (``terminate called without an active exception``,
    exit 134, after all the work was done)."""
    mx.clear_streams()


class _Wired:
    """The process's wired-memory limit while generations run: raised by the first, put back
    by the last (generations interleave, on one thread or several)."""

    lock = threading.Lock()
    held = 0
    before = 0


def recommended_working_set() -> int | None:
    """The most memory the GPU should keep resident (Metal's recommended working set), or
    None where the backend reports none (the CPU, CUDA): there, no wired limit is set."""
    size = mx.device_info().get("max_recommended_working_set_size")
    return int(size) if size else None


def model_bytes(models) -> int:
    """The bytes the weights of ``models`` hold (an array two of them share counted once)."""
    from mlx.utils import tree_flatten

    seen = {}
    for model in models:
        if model is not None and hasattr(model, "parameters"):
            seen.update((id(x), x.nbytes) for _, x in tree_flatten(model.parameters()))
    return sum(seen.values())


@contextlib.contextmanager
def wired_limit(models):
    """The wired limit at the recommended working set while a generation runs, and the
    previous limit back after it, as mlx-lm's ``wired_limit``: the weights stay resident
    between steps instead of being paged out. A warning when the models nearly fill it."""
    limit = recommended_working_set()
    if limit is None:
        yield
        return
    with _Wired.lock:
        if _Wired.held == 0:
            size = model_bytes(models)
            if size > 0.9 * limit:
                warnings.warn(f"generating with models of {size // 2**20} MB, close to the "
                              f"GPU's recommended working set of {limit // 2**20} MB: this "
                              f"can be slow", ResourceWarning, stacklevel=3)
            _Wired.before = mx.set_wired_limit(limit)
        _Wired.held += 1
    try:
        yield
    finally:
        with _Wired.lock:
            _Wired.held -= 1
            if _Wired.held == 0:
                # never change the limit under an evaluation still running
                mx.synchronize(generation_stream())
                mx.synchronize()
                mx.set_wired_limit(_Wired.before)


def housekept(tokens: Iterator[int], models) -> Iterator[int]:
    """``tokens`` (a generation's generator) with the housekeeping around it: each of its
    steps computes on :func:`generation_stream` (the consumer's code between two tokens
    runs on its own default stream), under :func:`wired_limit`, and the allocator's cache
    is cleared after the first token (the prefill's buffers) and every ``CLEAR_EVERY``
    tokens after it."""
    with wired_limit(models):
        try:
            n = 0
            while True:
                with mx.stream(generation_stream()):
                    token = next(tokens, None)
                if token is None:
                    return
                yield token
                if n % CLEAR_EVERY == 0:
                    mx.clear_cache()
                n += 1
        finally:
            with mx.stream(generation_stream()):
                tokens.close()       # a generation closed early undoes what it built ahead
