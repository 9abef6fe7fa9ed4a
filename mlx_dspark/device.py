"""What the device that runs decides: whether MLX computes on a GPU, and the dtype a scaled
matmul accumulates in. Below the models and the memory pre-flight, which both follow it."""

from __future__ import annotations

import mlx.core as mx


def on_gpu() -> bool:
    """Whether MLX computes on a GPU by default (Metal, or any other GPU backend MLX has):
    dtype and kernel choices follow the device that runs, not the platform."""
    return mx.default_device().type == mx.DeviceType.gpu


def accumulation_dtype(dtype):
    """The dtype a scaled matmul computes in for activations of ``dtype``: float32 for
    float16 (the unscaled product overflows it), else ``dtype``."""
    return mx.float32 if dtype == mx.float16 else dtype
