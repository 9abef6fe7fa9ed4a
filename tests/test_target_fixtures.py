"""The target against oracles nobody here wrote: transformers' NemotronHForCausalLM logits and
residual streams (fp32) for real ModelOpt exports of a tiny Nemotron-H (BF16, W4A16_NVFP4 and
MIXED_PRECISION NVFP4+FP8), loaded through the real converter; and mlx-lm's ``nemotron_h`` on
the same weights (ModelOpt's own dequantization). See tests/fixtures/README.md."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from testkit.target_helpers import mlx_lm_from_hf_weights

from mlx_dspark.converter.convert import convert
from mlx_dspark.models.nemotron_h import load_target

FIX = Path(__file__).parent / "fixtures"
EXPORTS = ["bf16", "w4a16", "mixed"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {e: convert(str(FIX / "modelopt" / f"target_{e}"), root / e, progress=False)
            for e in ("w4a16", "mixed")}


def _model_dir(export, converted):
    # BF16: the HF save_pretrained directory itself (per-expert tensors, conv (C,1,K))
    return FIX / "modelopt" / "target_bf16" if export == "bf16" else converted[export]


def _reference(export):
    return np.load(FIX / "reference" / f"target_{export}_forward.npz")


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("policy", ["quantized", "dequantized"])
def test_logits_and_residuals_match_transformers(export, policy, converted):
    model = load_target(str(_model_dir(export, converted)), dtype=mx.float32, nvfp4=policy)
    ref = _reference(export)
    layers = tuple(range(model.config.num_hidden_layers))
    for i in range(3):                     # lengths 5, 16, 50: serial, one chunk, chunked
        toks = mx.array(ref[f"tokens_{i}"])[None]
        logits, taps = model.step(toks, model.make_cache(), tap_layers=layers)
        logits = np.array(logits[0])
        assert _rel(logits, ref[f"logits_{i}"]) < 1e-5
        assert (logits.argmax(-1) == ref[f"logits_{i}"].argmax(-1)).all()
        res = ref[f"residual_{i}"]                                    # (layers, T, hidden)
        taps = np.array(taps).reshape(taps.shape[0], len(layers), -1).transpose(1, 0, 2)
        assert _rel(taps, res) < 1e-5
        # the cache-free forward is the same computation
        np.testing.assert_array_equal(np.array(model(toks)[0]), logits)


def test_fixture_prompts_stay_clear_of_the_dt_clamp():
    """transformers clamps dt at time_step_min in prefill only; we (like mlx-lm) use
    time_step_limit everywhere. The comparison above is only meaningful because no dt of
    the fixture prompts reaches the clamp."""
    for export in EXPORTS:
        cfg = json.loads((FIX / "modelopt" / f"target_{export}" / "config.json").read_text())
        info = json.loads((FIX / "reference" / f"target_{export}_forward.json").read_text())
        mins = [v for p in info["prompts"] for v in p["mamba_min_dt"].values()]
        assert len(mins) == 9 and min(mins) > cfg["time_step_min"]


def _dequantized_weights(export):
    """The fp32 weights the export stands for, by ModelOpt's own dequantization."""
    d = FIX / "modelopt" / f"target_{export}"
    raw = mx.load(str(d / "model.safetensors"))
    deq = np.load(FIX / "reference" / f"target_{export}_dequant.npz") if export != "bf16" \
        else {}
    w = {}
    for k, v in raw.items():
        p = k.rsplit(".", 1)[0]
        if p in deq:
            if k.endswith(".weight"):
                w[k] = mx.array(deq[p])
        elif not k.endswith(("_scale", "_scale_2")):
            w[k] = v.astype(mx.float32)
    return w


@pytest.mark.parametrize("export", EXPORTS)
def test_logits_match_mlx_lm_on_modelopt_dequantized_weights(export, converted):
    cfg = json.loads((FIX / "modelopt" / f"target_{export}" / "config.json").read_text())
    cfg["time_step_limit"] = [0.0, float("inf")]
    ref_model = mlx_lm_from_hf_weights(cfg, _dequantized_weights(export))
    model = load_target(str(_model_dir(export, converted)), dtype=mx.float32)
    toks = mx.array(_reference(export)["tokens_2"])[None]
    a, b = np.array(model(toks)), np.array(ref_model(toks))
    assert _rel(a, b) < 1e-5
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("export", ["bf16", "mixed"])
def test_incremental_decoding_matches_transformers(export, converted):
    """Chunked prefill of 20 tokens, then one token at a time (the serial recurrence and
    the KV cache) over the 50-token prompt: still the full-forward reference logits."""
    model = load_target(str(_model_dir(export, converted)), dtype=mx.float32)
    ref = _reference(export)
    toks = mx.array(ref["tokens_2"])[None]
    cache = model.make_cache()
    parts = [model.step(toks[:, :20], cache)[0]]
    parts += [model.step(toks[:, i:i + 1], cache)[0] for i in range(20, toks.shape[1])]
    logits = np.array(mx.concatenate(parts, axis=1)[0])
    assert _rel(logits, ref["logits_2"]) < 1e-5
    assert (logits.argmax(-1) == ref["logits_2"].argmax(-1)).all()


def test_an_unconverted_modelopt_export_is_refused():
    with pytest.raises(ValueError, match="mlx-dspark convert"):
        load_target(str(FIX / "modelopt" / "target_w4a16"))
