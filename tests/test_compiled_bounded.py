"""Compiled functions stay bounded however many prompt lengths and sampling settings a
long-running server sees: MLX caches a compiled graph per input shape and per value of each
non-array argument, so only short fixed shapes are compiled and the drafter keeps the
compiled draws of its last few sampling settings."""

from __future__ import annotations

import pytest

from mlx_dspark import api
from mlx_dspark.drafters.dspark import DRAW_SETTINGS
from mlx_dspark.kernels import mamba as K
from mlx_dspark.kernels.norm import FUSED_ROWS


@pytest.fixture(scope="module")
def pair():
    return api.load()


def test_prompts_of_every_length_compile_only_short_shapes(pair, monkeypatch):
    seen = set()
    for name in ("_conv_compiled", "_conv_bias_compiled", "_discretize_compiled"):
        compiled = getattr(K, name)

        def recording(x, *rest, compiled=compiled):
            seen.add(x.shape[1])
            return compiled(x, *rest)

        monkeypatch.setattr(K, name, recording)
    for n in (1, 2, 5, 9, 16, 17, 23, 40):
        api.generate(pair, list(range(5, 5 + n)), max_tokens=3, speculative="on")
    assert seen and max(seen) <= FUSED_ROWS + 3     # the conv's input carries K-1 more rows


def test_the_drafter_keeps_compiled_draws_of_its_last_few_settings(pair):
    first = api.generate(pair, "Hello", max_tokens=12, speculative="on", temperature=0.7,
                         seed=1, sampling="reproducible").tokens
    for i in range(DRAW_SETTINGS + 2):
        api.generate(pair, "Hello", max_tokens=4, speculative="on",
                     temperature=0.5 + i / 1000, seed=i)
    assert len(pair.drafter._draws.compiled) == DRAW_SETTINGS
    again = api.generate(pair, "Hello", max_tokens=12, speculative="on", temperature=0.7,
                         seed=1, sampling="reproducible").tokens
    assert again == first                   # compiled anew after eviction: the same draws
