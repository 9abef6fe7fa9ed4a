"""The drafter on real ModelOpt bytes: NVIDIA's layout packed by nvidia-modelopt 0.47
(tests/fixtures/modelopt/drafter_nvfp4), converted by ``mlx-dspark convert`` together with its
ModelOpt-exported tiny target (target_w4a16), loaded, gated, and checked against the float64
reference, whose own NVFP4 decoding is first checked against ModelOpt's dequantization."""

import glob
import os

import mlx.core as mx
import numpy as np
import pytest
from testkit.reference_drafter import (ReferenceDrafter,
    assert_proposals_match,
    dense_weight,
    read_safetensors)

from mlx_dspark.converter.convert import convert
from mlx_dspark.drafters import load_drafter
from mlx_dspark.models.nemotron_h import load_target

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
FP32_TOL = 1e-5  # measured 4.1e-7 (packed) / 5.3e-7 (decoded): max |z - z_ref| / max |z_ref|


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    target = convert(os.path.join(FIX, "modelopt", "target_w4a16"), root / "target", progress=False)
    drafter = convert(os.path.join(FIX, "modelopt", "drafter_nvfp4"), root / "drafter",
                      progress=False)
    return str(target), str(drafter)


@pytest.fixture(scope="module")
def reference(converted):
    target, drafter = converted
    t = {}
    for f in sorted(glob.glob(os.path.join(target, "*.safetensors"))):
        t.update(read_safetensors(f))
    return ReferenceDrafter(drafter, t["backbone.embeddings.weight"], t["lm_head.weight"])


def test_reference_decodes_nvfp4_like_modelopt(reference):
    """The reference's E2M1 x E4M3 x ws2 decoding of the converted bytes against ModelOpt's
    own NVFP4QTensor.dequantize (fp32, which multiplies the two scales first): measured
    9.8e-8 relative at most, i.e. within one fp32 ulp."""
    want = np.load(os.path.join(FIX, "reference", "drafter_nvfp4_dequant.npz"))
    assert sorted(want.files) == sorted(
        ["fc", "markov_head.markov_w2"] + [f"layers.{i}.mlp.{p}_proj" for i in range(2)
                                           for p in ("gate", "up", "down")])
    for prefix in want.files:
        got = dense_weight(reference.t, prefix)
        np.testing.assert_allclose(got, want[prefix].astype(np.float64), rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("nvfp4", ["quantized", "dequantized"])
def test_modelopt_drafter_loads_through_the_gate_and_matches_reference(converted, reference,
                                                                      nvfp4):
    target_path, drafter_path = converted
    target = load_target(target_path, dtype=mx.float32, nvfp4=nvfp4)
    d = load_drafter(drafter_path, target, dtype=mx.float32, nvfp4=nvfp4)
    assert d.gate_report == "46/46 tensors match"
    assert "embed_tokens" in d  # this drafter's embedding is its own, not the target's
    assert d.target_layer_ids == [1, 3, 5, 7]

    assert_proposals_match(target, d, reference, FP32_TOL)   # 19 tokens: past the 8-key window
