"""Nemotron 3.5 Lightning's real widths (hidden 2688, 64x64 Mamba heads with 8x128 groups,
32/2 x 128 attention, 1856/3712 experts) in its real mixed NVFP4/FP8/BF16 export layout,
cut to four layers, eight experts and a small vocabulary: the synthetic ModelOpt export
goes through the real converter and loader, and the result is checked against mlx-lm's
nemotron_h running the float weights the *source* bytes stand for (decoded here with
NumPy, independently of the converter and of quant.py)."""

import mlx.core as mx
import numpy as np
import pytest
from testkit.target_helpers import mlx_lm_from_hf_weights
from test_target import _state

from mlx_dspark.converter.convert import convert
from testkit.synthetic import (E4M3,
    lightning_config,
    nvfp4_dequantize,
    read_raw_checkpoint,
    synth_lightning)
from mlx_dspark.models.nemotron_h import load_target

# a real-width Lightning-shaped checkpoint: the slow lane
pytestmark = pytest.mark.slow

PATTERN, EXPERTS, VOCAB = "M*EM", 8, 512


@pytest.fixture(scope="module")
def real_width(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    synth_lightning(root / "src", pattern=PATTERN, experts=EXPERTS, vocab=VOCAB)
    convert(str(root / "src"), root / "out", progress=False)
    return root


@pytest.fixture(scope="module")
def ours(real_width):
    return load_target(str(real_width / "out"), dtype=mx.float32)


def _float_weights(src) -> dict:
    """The source export decoded to float32 under HF names (ModelOpt's formulas)."""
    raw = read_raw_checkpoint(src)
    out = {}
    for name, (dtype, shape, data) in raw.items():
        if name.endswith((".weight_scale", ".weight_scale_2")):
            continue
        p = name[:-len(".weight")]
        if dtype == "U8":
            s = np.frombuffer(raw[f"{p}.weight_scale"][2], np.uint8).reshape(shape[0], -1)
            ws2 = np.frombuffer(raw[f"{p}.weight_scale_2"][2], np.float32)[0]
            w = nvfp4_dequantize(np.frombuffer(data, np.uint8).reshape(shape), s, ws2)
        elif dtype == "F8_E4M3":
            scale = np.frombuffer(raw[f"{p}.weight_scale"][2], np.float32)[0]
            w = E4M3[np.frombuffer(data, np.uint8)].reshape(shape) * scale
        elif dtype == "BF16":
            w = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
            w = w.reshape(shape)
        else:
            w = np.frombuffer(data, np.float32).reshape(shape)
        out[name] = mx.array(w)
    return out


def _tokens(n, seed=0):
    return mx.random.randint(0, VOCAB, (1, n), key=mx.random.key(seed))


def test_real_width_checkpoint_matches_mlx_lm_on_the_source_float_weights(real_width, ours):
    cfg = lightning_config(PATTERN, EXPERTS, VOCAB)
    cfg["time_step_limit"] = [0.0, float("inf")]
    ref = mlx_lm_from_hf_weights(cfg, _float_weights(real_width / "src"))
    toks = _tokens(12)
    a, b = ours(toks), ref(toks)
    assert (mx.abs(a - b).max() / mx.abs(b).max()).item() < 1e-5
    assert (a.argmax(-1) == b.argmax(-1)).all().item()


def test_real_width_decoding_equals_the_full_forward(ours):
    toks = _tokens(10, seed=1)
    cache = ours.make_cache()
    pieces = [ours.step(toks[:, :6], cache)[0]] + [ours.step(toks[:, i:i + 1], cache)[0]
                                                  for i in range(6, 10)]
    full = ours(toks)
    inc = mx.concatenate(pieces, axis=1)
    assert (mx.abs(inc - full).max() / mx.abs(full).max()).item() < 1e-5


@pytest.mark.parametrize("accepted", [0, 2])
def test_real_width_rollback_equals_a_fresh_run(ours, accepted):
    """verify(bonus + 3 drafts), keep bonus + ``accepted``: KV, conv and SSM state and the
    next step's logits equal a fresh run over the kept tokens, to the bit (fp32)."""
    toks = _tokens(10, seed=2)
    kept = 5 + accepted + 1
    cache, fresh = ours.make_cache(), ours.make_cache()
    ours.step(toks[:, :5], cache)
    ours.verify(toks[:, 5:9], cache)
    ours.commit(cache, accepted + 1)
    ours.step(toks[:, :kept], fresh)
    nxt = toks[:, 9:10]
    pairs = list(zip(_state(cache), _state(fresh)))
    pairs.append((ours.step(nxt, cache)[0], ours.step(nxt, fresh)[0]))
    assert all(mx.array_equal(x, y) for x, y in pairs)


def test_real_width_grouped_experts_equal_the_plain_path(ours, monkeypatch):
    from test_moe_grouping import equal_with_and_without_grouping
    assert equal_with_and_without_grouping(ours, _tokens(8, seed=3), monkeypatch)
