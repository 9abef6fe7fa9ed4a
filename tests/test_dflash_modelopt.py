"""A DFlash export packed by ModelOpt 0.47 (tests/fixtures/modelopt/dflash_nvfp4, made by
tests/fixtures/make_dflash_fixture.py): ``mlx-dspark convert`` takes it (kind ``drafter``,
receipt with the source's hashes), ``--drafter DIR`` recognises it by its architectures, the
weight-load gate passes, and its proposals on the ModelOpt target's taps match the float64
z-lab reference decoded from the converted bytes. (Byte-for-byte carry-over and ModelOpt's own
dequantization: tests/test_convert_modelopt.py, which runs on every committed export.)"""

import glob
import hashlib
import json
import os

import mlx.core as mx
import pytest
from testkit.reference_drafter import assert_proposals_match, dense_weight, read_safetensors
from testkit.reference_dflash import ReferenceDFlash

from mlx_dspark.converter.convert import convert
from mlx_dspark.drafters import kind_of, load_drafter
from mlx_dspark.drafters.dflash import DFlashDrafter
from mlx_dspark.models.nemotron_h import load_target

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
SRC = os.path.join(FIX, "modelopt", "dflash_nvfp4")
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = convert(os.path.join(FIX, "modelopt", "target_w4a16"), root / "target", progress=False)
    drafter = convert(SRC, root / "drafter", progress=False)
    return str(target), str(drafter)


def test_the_conversion_receipt_records_the_nvidia_export(converted):
    _, drafter = converted
    receipt = json.load(open(os.path.join(drafter, "MERERUN_CONVERSION.json")))
    assert receipt["model_kind"] == "drafter"
    for name in ("config.json", "model.safetensors", "hf_quant_config.json"):
        data = open(os.path.join(SRC, name), "rb").read()
        assert receipt["source"]["files"][name] == {"size": len(data),
                                                    "sha256": hashlib.sha256(data).hexdigest()}
    out = open(os.path.join(drafter, "model.safetensors"), "rb").read()
    assert receipt["outputs"]["model.safetensors"]["sha256"] == hashlib.sha256(out).hexdigest()
    assert kind_of(drafter).name == "dflash"


@pytest.mark.parametrize("nvfp4", ["quantized", "dequantized"])
def test_modelopt_dflash_loads_through_the_gate_and_matches_the_reference(converted, nvfp4):
    target_path, drafter_path = converted
    target = load_target(target_path, dtype=mx.float32, nvfp4=nvfp4)
    d = load_drafter(drafter_path, target, dtype=mx.float32, nvfp4=nvfp4)
    assert isinstance(d, DFlashDrafter)
    assert d.gate_report == "39/39 tensors match"
    assert d.config.causal == (False, False) and d.config.softcap == 12.0

    t = {}
    for f in sorted(glob.glob(os.path.join(target_path, "*.safetensors"))):
        t.update(read_safetensors(f))
    w = read_safetensors(os.path.join(drafter_path, "model.safetensors"))
    dense = {n: (dense_weight(w, n[:-len(".weight")]) if f"{n[:-7]}.scales" in w else w[n])
             for n in w if n.endswith(".weight")}
    raw = json.load(open(os.path.join(drafter_path, "config.json")))
    ref = ReferenceDFlash(raw, dense, t["backbone.embeddings.weight"], t["lm_head.weight"])

    assert_proposals_match(target, d, ref, FP32_TOL)      # 19 tokens: past the 6-key window
