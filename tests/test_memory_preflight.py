"""The memory pre-flight: a pair too large for the device is refused before loading, with
what it needs, what there is and what to do; the estimate matches what loading takes."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_dspark as md
from mlx_dspark import api, cli
from mlx_dspark.checkpoint import memory
from mlx_dspark.models.nemotron_h import load_target

TARGET, DRAFTER = api.DEMO / "target", api.DEMO / "drafter"


def _budget(monkeypatch, nbytes):
    monkeypatch.setattr(memory, "available_memory", lambda: (nbytes, "the test's budget"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_estimated_weights_match_what_loading_takes(dtype):
    model = load_target(TARGET, dtype=dtype)
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    estimate, _ = memory.weight_bytes(TARGET, dtype)
    assert abs(estimate - loaded) <= 0.02 * loaded


def test_a_pair_over_budget_is_refused_before_loading(monkeypatch):
    _budget(monkeypatch, 1_000_000)
    monkeypatch.setattr("mlx_dspark.models.nemotron_h.load_target", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(memory.InsufficientMemory) as e:
        md.load(TARGET, DRAFTER, dtype=mx.float32)
    need, _ = memory.needed_bytes(TARGET, DRAFTER, mx.float32)
    msg = str(e.value)
    assert f"needs about {need / 1e9:.1f} GB" in msg and "the test's budget is 0.0 GB" in msg
    assert "--no-memory-check" in msg and "\n" not in msg


def test_bfloat16_is_suggested_when_it_would_fit(monkeypatch):
    fp32, _ = memory.needed_bytes(TARGET, DRAFTER, mx.float32)
    bf16, _ = memory.needed_bytes(TARGET, DRAFTER, mx.bfloat16)
    assert bf16 < fp32
    _budget(monkeypatch, (bf16 + fp32) // 2)
    with pytest.raises(memory.InsufficientMemory, match="--dtype bfloat16"):
        md.load(TARGET, DRAFTER, dtype=mx.float32)
    md.load(TARGET, DRAFTER, dtype=mx.bfloat16)


def test_memory_check_false_loads_anyway(monkeypatch):
    _budget(monkeypatch, 1_000_000)
    pair = md.load(TARGET, DRAFTER, memory_check=False)
    assert pair.target is not None and pair.drafter is not None


def test_cli_prints_one_line_and_no_memory_check_overrides(monkeypatch, capsys):
    _budget(monkeypatch, 1_000_000)
    argv = ["generate", "-p", "def f(x):", "--max-tokens", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs about" in err and "Traceback" not in err
    assert cli.main(argv + ["--no-memory-check"]) == 0


def test_caches_grow_with_context_for_attention_only():
    cfg = {"hybrid_override_pattern": "M*", "hidden_size": 2688, "num_attention_heads": 32,
           "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64,
           "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}
    one, two = (memory.cache_bytes(cfg, n, mx.float32) for n in (1000, 2000))
    assert two - one == 1000 * 2 * 2 * 128 * 4          # K and V, 2 heads x 128, fp32
    assert one - 1000 * 2 * 2 * 128 * 4 == 4 * (64 * 64 * 128 + 3 * (4096 + 2 * 8 * 128))


def test_the_mtp_block_counts_only_when_it_drafts(tmp_path):
    from mlx_dspark.converter import convert
    from functools import partial
    from mlx_dspark.drafters import load_drafter
    load_mtp = partial(load_drafter, "mtp")
    from testkit.synthetic import synth_target
    synth_target(tmp_path / "src", "MIXED_PRECISION")
    keep = convert(str(tmp_path / "src"), tmp_path / "keep", progress=False)
    drop = convert(str(tmp_path / "src"), tmp_path / "drop", keep_mtp=False, progress=False)
    assert memory.weight_bytes(keep, mx.float32) == memory.weight_bytes(drop, mx.float32)
    serial, _ = memory.needed_bytes(keep, None, mx.float32)
    with_mtp, _ = memory.needed_bytes(keep, "mtp", mx.float32)
    block = load_mtp(load_target(str(keep), dtype=mx.float32))
    loaded = sum(v.nbytes for _, v in tree_flatten(block.parameters()))
    # the block's weights (estimated as loaded) and its attention layer's K/V
    assert loaded <= with_mtp - serial <= loaded + memory.cache_bytes(
        {**json.loads((keep / "config.json").read_text()), "hybrid_override_pattern": "*"},
        memory.DEFAULT_CONTEXT, mx.float32) + 0.02 * loaded
