"""Multi-token steps group the (token, expert) pairs by expert (sorted gather, so tokens that
share an expert read it once); the outputs equal the ungrouped path's to the bit (fp32)."""

import mlx.core as mx
import pytest
from testkit.target_helpers import twin_models

from mlx_dspark import api
from mlx_dspark.models.nemotron_h import MoE, load_target
from testkit.toy import tiny_config, tiny_target


def equal_with_and_without_grouping(model, tokens, monkeypatch) -> bool:
    monkeypatch.setattr(MoE, "sort_min_tokens", 2)
    grouped = model.verify(tokens, model.make_cache())[0]
    monkeypatch.setattr(MoE, "sort_min_tokens", 1 << 30)
    plain = model.verify(tokens, model.make_cache())[0]
    return mx.array_equal(grouped, plain).item()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_grouped_experts_equal_the_plain_path_on_the_demo_target(n, monkeypatch):
    """The demo target: a real ModelOpt NVFP4 export (packed experts, gather_qmm)."""
    model = load_target(api.DEMO / "target", dtype=mx.float32)
    toks = mx.random.randint(0, model.config.vocab_size, (1, n), key=mx.random.key(n))
    assert equal_with_and_without_grouping(model, toks, monkeypatch)


def test_grouped_experts_equal_the_plain_path_on_float_experts(monkeypatch):
    model = twin_models(tiny_config())[0]                 # dense experts (gather_mm)
    toks = mx.random.randint(0, 97, (1, 6), key=mx.random.key(0))
    assert equal_with_and_without_grouping(model, toks, monkeypatch)


def test_grouped_experts_equal_the_plain_path_on_a_latent_moe(monkeypatch):
    model = tiny_target(moe_latent_size=32)              # experts in the latent width
    toks = mx.random.randint(0, 97, (1, 6), key=mx.random.key(1))
    assert equal_with_and_without_grouping(model, toks, monkeypatch)


@pytest.mark.parametrize("least, verify_sorted", [(2, True), (11, False)])
def test_the_threshold_decides_which_steps_group_experts(monkeypatch, least, verify_sorted):
    """2 (Metal's default): every verify groups; 11 (the CPU's): a 4-token verify does not.
    A single token never does."""
    from mlx_dspark.models.quant import DenseExperts
    monkeypatch.setattr(MoE, "sort_min_tokens", least)
    seen = []
    real = DenseExperts.__call__

    def spy(self, x, idx, sorted_indices=False):
        seen.append(sorted_indices)
        return real(self, x, idx, sorted_indices)
    monkeypatch.setattr(DenseExperts, "__call__", spy)
    model = twin_models(tiny_config())[0]                 # two MoE layers, up and down each
    model.verify(mx.array([[1, 2, 3, 4]]), model.make_cache())
    assert seen == [verify_sorted] * 4
    seen.clear()
    model.step(mx.array([[5]]), model.make_cache())
    assert seen == [False] * 4
