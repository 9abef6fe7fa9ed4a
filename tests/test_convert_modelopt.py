"""The converter on real ModelOpt 0.47 exports (tests/fixtures/modelopt/, made by
tests/fixtures/make_modelopt_fixtures.py): bytes carried over exactly, and the converted
layout dequantizes to ModelOpt's own dequantization (tests/fixtures/reference/*_dequant.npz)."""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from testkit.synthetic import read_raw_checkpoint
from mlx_dspark.converter import convert

FIXTURES = Path(__file__).parent / "fixtures"
EXPORTS = sorted(p.name for p in (FIXTURES / "modelopt").iterdir() if p.is_dir())
REFERENCE = {"target_w4a16": "target_w4a16_dequant.npz", "target_mixed": "target_mixed_dequant.npz",
             "drafter_nvfp4": "drafter_nvfp4_dequant.npz", "dflash_nvfp4": "dflash_nvfp4_dequant.npz"}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    return {name: convert(str(FIXTURES / "modelopt" / name), root / name, progress=False)
            for name in EXPORTS}


def load(out: Path) -> dict:
    return mx.load(str(out / "model.safetensors"))


def raw(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def locate(w: dict, name: str):
    """The converted array holding source tensor ``name`` (an expert's slice if stacked)."""
    m = _EXPERT.match(name)
    if m is None:
        return w[name]
    return w[f"{m[1]}.{m[3]}"][int(m[2])]


def renamed(name: str) -> str | None:
    """Source tensor name -> converted tensor name (None: dropped)."""
    if name.endswith((".input_scale", ".k_scale", ".v_scale")):
        return None
    return name[:-len("weight_scale")] + "scales" if name.endswith(".weight_scale") else name


def test_the_committed_exports_are_all_here():
    assert {"target_bf16", "target_w4a16", "target_mixed", "drafter_nvfp4",
            "dflash_nvfp4"} <= set(EXPORTS)


@pytest.mark.parametrize("name", EXPORTS)
def test_every_source_tensor_is_carried_over_byte_for_byte(converted, name):
    src = read_raw_checkpoint(FIXTURES / "modelopt" / name)
    w = load(converted[name])
    expected = set()
    for tname, (dtype, shape, data) in src.items():
        fp8_scale = tname.endswith(".weight_scale") and dtype == "F32"
        out = tname if fp8_scale else renamed(tname)
        if out is None:
            continue
        assert raw(locate(w, out)) == data, tname
        m = _EXPERT.match(out)
        expected.add(f"{m[1]}.{m[3]}" if m else out)
    assert set(w) == expected          # nothing added, nothing else dropped


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_converted_layout_dequantizes_to_modelopts_own_values_within_1ulp(converted, name):
    ref = np.load(FIXTURES / "reference" / REFERENCE[name])
    w = load(converted[name])
    for p in ref.files:
        want = ref[p]
        if locate(w, f"{p}.weight").dtype == mx.uint32:           # NVFP4
            got = mx.dequantize(locate(w, f"{p}.weight"), locate(w, f"{p}.scales"), group_size=16,
                                bits=4, mode="nvfp4", dtype=mx.float32) * locate(w, f"{p}.weight_scale_2")
            got = np.array(got)
            got[got == 0] = 0.0               # ModelOpt decodes code 8 (-0) as +0.0
            ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
            assert ulps.max() <= 1, p
        else:                                                      # FP8: exact
            got = np.array(mx.from_fp8(locate(w, f"{p}.weight"), dtype=mx.float32)) * \
                np.array(locate(w, f"{p}.weight_scale"))
            np.testing.assert_array_equal(got, want, err_msg=p)
        assert np.count_nonzero(want) > want.size // 2, p


@pytest.mark.parametrize("name", EXPORTS)
def test_config_layout_block_matches_the_tensors(converted, name):
    out = converted[name]
    cfg = json.loads((out / "config.json").read_text())
    text = (out / "config.json").read_text()
    assert "\\u0000" not in text and "pt_name_sentinel" not in text and "__float__" not in text
    w = load(out)
    mods = cfg["quantization"]["modules"]
    fmt_of = {mx.uint32: "nvfp4", mx.uint8: "fp8", mx.bfloat16: "bf16", mx.float32: "float32"}
    assert mods and all(fmt_of[w[f"{p}.weight"].dtype] == f for p, f in mods.items())
    if name.startswith("target"):
        assert cfg["hybrid_override_pattern"] == "MEM*EM-E"
        assert cfg["time_step_limit"] == [0.0, float("inf")]
    kinds = {"target_bf16": {"bf16", "float32"}, "target_w4a16": {"nvfp4", "bf16", "float32"},
             "target_mixed": {"nvfp4", "fp8", "bf16", "float32"}, "drafter_nvfp4": {"nvfp4", "bf16"},
             "dflash_nvfp4": {"nvfp4", "bf16"}}
    assert set(mods.values()) == kinds[name]


def test_mixed_export_drops_input_scales_and_keeps_fp8_mamba_projections(converted):
    w = load(converted["target_mixed"])
    assert not any(k.endswith("input_scale") for k in w)
    assert w["backbone.layers.0.mixer.in_proj.weight"].dtype == mx.uint8
    assert w["backbone.layers.5.mixer.out_proj.weight_scale"].shape == ()
    assert w["backbone.layers.1.mixer.experts.up_proj.weight_scale_2"].shape == (8,)


def test_real_exports_convert_deterministically(converted, tmp_path):
    again = convert(str(FIXTURES / "modelopt" / "target_mixed"), tmp_path / "again", progress=False)
    first = converted["target_mixed"]
    for f in sorted(first.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
