"""``md.load(..., dtype="bfloat16")``: every drafter holds its float parameters in the dtype
asked for: MTP's experts (float32 on the CPU before: its ``gather_mm`` computes in float32 only,
so they are cast as they are used) and EAGLE-3's head (float32 before) included. What may stay
float32: scales, the router and its bias; index tables keep their integer types. Greedy
speculation with them still equals serial greedy."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_dspark as md

STAYS_FLOAT32 = ("scales", "scale", "weight_scale", "weight_scale_2",    # scales
                 "gate.weight", "gate.e_score_correction_bias")             # the router, its bias
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module", params=["dspark", "mtp", "eagle3", "dflash"])
def pair(request):
    return md.load(drafter=request.param, dtype="bfloat16")


def test_every_float_parameter_of_the_drafter_follows_the_dtype_asked_for(pair):
    floats = {name: p.dtype for name, p in tree_flatten(pair.drafter.parameters())
              if mx.issubdtype(p.dtype, mx.floating)}
    assert floats
    wrong = {name: dtype for name, dtype in floats.items() if dtype != mx.bfloat16
             and not (name.endswith(STAYS_FLOAT32) and dtype == mx.float32)}
    assert not wrong, wrong


def test_greedy_speculation_in_bfloat16_equals_serial(pair):
    serial = md.generate(pair, PROMPT, max_tokens=24, speculative=False).tokens
    for n in (1, 3, 5):
        out = md.generate(pair, PROMPT, max_tokens=24, speculative=True, num_draft=n)
        assert out.tokens == serial, n
        assert out.stats["rounds"] > 0
