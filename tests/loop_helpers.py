"""Serial references for the loop, controller and API tests (the tiny random models they run
on: mlx_dspark.toy)."""

from __future__ import annotations

import mlx.core as mx

from mlx_dspark.speculative import decode


def serial_greedy(target, prompt, max_tokens) -> list[int]:
    return list(decode(target, None, prompt, max_tokens=max_tokens, speculative=False))


def top2_gap(target, tokens) -> float:
    """Gap between the target's two largest logits after ``tokens`` (full forward)."""
    logits = target(mx.array([tokens]))[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]
