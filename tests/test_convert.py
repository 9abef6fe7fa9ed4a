"""The converter's output: byte-for-byte NVFP4/FP8 repacking, exact dequantization, layout.

Sources are synthetic ModelOpt-layout checkpoints built with NumPy (testkit/synthetic.py),
one per supported quant algorithm, plus the DSpark drafter."""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors

from testkit.synthetic import E4M3, nvfp4_dequantize, synth_drafter, synth_target
from mlx_dspark.converter import convert
from mlx_dspark.models.quant import make_linear

ALGOS = ["W4A16_NVFP4", "NVFP4", "FP8", "MIXED_PRECISION"]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """algo -> (source tensors, output dir); the drafter under "drafter"."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for algo in ALGOS:
        src = synth_target(root / f"src-{algo}", algo, shards=2 if algo == "FP8" else 1)
        out[algo] = (src, convert(str(root / f"src-{algo}"), root / f"out-{algo}", progress=False))
    src = synth_drafter(root / "src-drafter")
    out["drafter"] = (src, convert(str(root / "src-drafter"), root / "out-drafter", progress=False))
    return out


def load_out(path: Path) -> dict:
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def out_bytes(w: mx.array, expert=None) -> bytes:
    w = w if expert is None else w[expert]
    return np.array(w.view(mx.uint16) if w.dtype == mx.bfloat16 else w).tobytes()


def out_name(name: str):
    """Source tensor name -> (output name, expert index or None)."""
    m = _EXPERT.match(name)
    return (f"{m[1]}.{m[3]}", int(m[2])) if m else (name, None)


def quantized_modules(src: dict, dtype: str):
    return sorted(n[:-len(".weight")] for n, t in src.items()
                  if n.endswith(".weight") and t[0] == dtype)


@pytest.mark.parametrize("algo", ["W4A16_NVFP4", "NVFP4", "MIXED_PRECISION", "drafter"])
def test_nvfp4_codes_block_scales_and_tensor_scales_are_the_source_bytes(converted, algo):
    src, out = converted[algo]
    w = load_out(out)
    mods = quantized_modules(src, "U8")
    assert len(mods) >= 5
    for p in mods:
        name, e = out_name(p)
        assert w[f"{name}.weight"].dtype == mx.uint32
        assert w[f"{name}.scales"].dtype == mx.uint8
        assert w[f"{name}.weight_scale_2"].dtype == mx.float32
        assert out_bytes(w[f"{name}.weight"], e) == src[f"{p}.weight"][2]
        assert out_bytes(w[f"{name}.scales"], e) == src[f"{p}.weight_scale"][2]
        assert out_bytes(w[f"{name}.weight_scale_2"], e) == src[f"{p}.weight_scale_2"][2]
        out_f, in_half = src[f"{p}.weight"][1]
        assert w[f"{name}.weight"].shape[-2:] == (out_f, in_half // 4)


@pytest.mark.parametrize("algo", ["W4A16_NVFP4", "NVFP4", "MIXED_PRECISION", "drafter"])
def test_mlx_nvfp4_dequantize_times_tensor_scale_matches_modelopt_formula_within_1ulp(
        converted, algo):
    src, out = converted[algo]
    w = load_out(out)
    for p in quantized_modules(src, "U8"):
        name, e = out_name(p)
        sel = (lambda a: a) if e is None else (lambda a: a[e])
        got = mx.dequantize(sel(w[f"{name}.weight"]), sel(w[f"{name}.scales"]), group_size=16,
                            bits=4, mode="nvfp4", dtype=mx.float32) * sel(w[f"{name}.weight_scale_2"])
        got = np.array(got)
        _, shape, packed = src[f"{p}.weight"]
        scale = np.frombuffer(src[f"{p}.weight_scale"][2], np.uint8).reshape(src[f"{p}.weight_scale"][1])
        ws2 = np.frombuffer(src[f"{p}.weight_scale_2"][2], np.float32)[0]
        want = nvfp4_dequantize(np.frombuffer(packed, np.uint8).reshape(shape), scale, ws2)
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        assert ulps.max() <= 1, p
        assert np.count_nonzero(want) > want.size // 2, p   # not a vacuous all-zero weight


@pytest.mark.parametrize("algo", ["FP8", "MIXED_PRECISION"])
def test_fp8_bytes_and_scale_are_verbatim_and_decode_exactly(converted, algo):
    src, out = converted[algo]
    w = load_out(out)
    mods = quantized_modules(src, "F8_E4M3")
    assert mods
    for p in mods:
        name, e = out_name(p)
        assert w[f"{name}.weight"].dtype == mx.uint8
        assert out_bytes(w[f"{name}.weight"], e) == src[f"{p}.weight"][2]
        assert out_bytes(w[f"{name}.weight_scale"], e) == src[f"{p}.weight_scale"][2]
        raw = np.frombuffer(src[f"{p}.weight"][2], np.uint8)
        scale = np.frombuffer(src[f"{p}.weight_scale"][2], np.float32)[0]
        q = w[f"{name}.weight"] if e is None else w[f"{name}.weight"][e]
        got = np.array(mx.from_fp8(q, dtype=mx.float32)).ravel() * scale
        np.testing.assert_array_equal(got, E4M3[raw] * scale)


@pytest.mark.parametrize("algo", ALGOS + ["drafter"])
def test_unquantized_tensors_keep_dtype_and_bytes(converted, algo):
    src, out = converted[algo]
    w = load_out(out)
    dense = [n for n, t in src.items() if t[0] in ("BF16", "F32") and not n.endswith("scale")
             and not n.endswith("_scale_2")]
    assert any(src[n][0] == "F32" for n in dense) or algo == "drafter"
    for n in dense:
        name, e = out_name(n)
        assert str(w[name].dtype) == {"BF16": "mlx.core.bfloat16", "F32": "mlx.core.float32"}[src[n][0]]
        assert out_bytes(w[name], e) == src[n][2], n


def test_experts_stack_in_expert_order_with_per_expert_tensor_scales(converted):
    src, out = converted["W4A16_NVFP4"]
    w = load_out(out)
    p = "backbone.layers.1.mixer.experts.up_proj"
    assert w[f"{p}.weight"].shape == (4, 32, 8) and w[f"{p}.scales"].shape == (4, 32, 4)
    assert w[f"{p}.weight_scale_2"].shape == (4,)
    ws2 = [np.frombuffer(src[f"backbone.layers.1.mixer.experts.{e}.up_proj.weight_scale_2"][2],
                         np.float32)[0] for e in range(4)]
    assert len(set(ws2)) == 4           # each expert kept its own scale, in order
    np.testing.assert_array_equal(np.array(w[f"{p}.weight_scale_2"]), np.array(ws2))
    assert not any(".experts.0." in k for k in w)


@pytest.mark.parametrize("algo", ["NVFP4", "FP8"])
def test_activation_and_kv_cache_scales_are_dropped_and_mtp_is_kept(converted, algo):
    src, out = converted[algo]
    w = load_out(out)
    assert any(n.endswith(".input_scale") for n in src)
    assert not any(k.endswith((".input_scale", ".k_scale", ".v_scale")) for k in w)
    assert any(n.startswith("mtp.") for n in src)
    assert "mtp.layers.1.mixer.experts.up_proj.weight" in w     # stacked like the backbone's


def test_the_mtp_block_is_the_source_bytes_and_no_mtp_drops_it(converted, tmp_path):
    src, out = converted["MIXED_PRECISION"]
    w = load_out(out)
    assert out_bytes(w["mtp.layers.0.eh_proj.weight"]) == src["mtp.layers.0.eh_proj.weight"][2]
    assert out_bytes(w["mtp.layers.0.mixer.q_proj.weight"]) == \
        src["mtp.layers.0.mixer.q_proj.weight"][2]                           # FP8
    modules = json.loads((out / "config.json").read_text())["quantization"]["modules"]
    assert modules["mtp.layers.0.eh_proj"] == "nvfp4"
    assert modules["mtp.layers.0.mixer.q_proj"] == "fp8"
    srcdir = out.parent / "src-MIXED_PRECISION"
    dropped = convert(str(srcdir), tmp_path / "o", keep_mtp=False, progress=False)
    assert not any(k.startswith("mtp.") for k in load_out(dropped))
    receipt = json.loads((dropped / "MERERUN_CONVERSION.json").read_text())
    assert receipt["options"] == {"keep_mtp": False}


def test_config_is_normalized_and_names_every_linear_module(converted):
    src, out = converted["MIXED_PRECISION"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hybrid_override_pattern"] == "MEM*E"
    assert cfg["time_step_limit"] == [0.0, float("inf")]
    q = cfg["quantization"]
    assert (q["layout"], q["group_size"], q["source_quant_algo"]) == \
        ("mlx-dspark/1", 16, "MIXED_PRECISION")
    mods = q["modules"]
    assert mods["backbone.layers.0.mixer.in_proj"] == "fp8"
    assert mods["backbone.layers.1.mixer.experts.up_proj"] == "nvfp4"
    assert mods["backbone.layers.2.mixer.in_proj"] == "bf16"
    assert mods["backbone.layers.3.mixer.q_proj"] == "bf16"
    assert mods["backbone.layers.1.mixer.gate"] == "float32"
    assert mods["lm_head"] == "bf16"
    assert "backbone.embeddings" not in mods
    # every module named in the config has exactly the tensors of its layout
    w = load_out(out)
    for p, fmt in mods.items():
        want = {"nvfp4": {"weight", "scales", "weight_scale_2"}, "fp8": {"weight", "weight_scale"}}
        have = {k[len(p) + 1:] for k in w if k.startswith(p + ".")} - {"e_score_correction_bias"}
        assert have == want.get(fmt, {"weight"}), p


def test_sentinel_exclude_globs_are_honoured(converted):
    _, out = converted["W4A16_NVFP4"]
    cfg = json.loads((out / "config.json").read_text())
    assert "\u0000" not in json.dumps(cfg, ensure_ascii=False)
    assert "backbone.layers.3.*" in cfg["quantization_config"]["ignore"]
    assert "backbone.layers.2.mixer.in_proj" in cfg["quantization_config"]["ignore"]
    mods = cfg["quantization"]["modules"]
    assert mods["backbone.layers.2.mixer.in_proj"] == "bf16"
    assert mods["backbone.layers.0.mixer.in_proj"] == "nvfp4"


def test_sharded_shuffled_source_gives_the_same_weights_file(converted, tmp_path):
    _, out = converted["W4A16_NVFP4"]
    synth_target(tmp_path / "src", "W4A16_NVFP4", shards=3)
    out2 = convert(str(tmp_path / "src"), tmp_path / "o", progress=False)
    a = (out / "model.safetensors").read_bytes()
    assert (out2 / "model.safetensors").read_bytes() == a


def test_large_outputs_are_sharded_with_an_index(converted, tmp_path):
    _, out = converted["W4A16_NVFP4"]
    srcdir = converted["W4A16_NVFP4"][1].parent / "src-W4A16_NVFP4"
    out2 = convert(str(srcdir), tmp_path / "o", progress=False, shard_bytes=40_000)
    shards = sorted(out2.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (out2 / "model.safetensors").exists()
    index = json.loads((out2 / "model.safetensors.index.json").read_text())
    w = load_out(out2)
    assert set(index["weight_map"]) == set(w)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in w.values())
    ref = load_out(out)
    assert all(out_bytes(w[k]) == out_bytes(ref[k]) for k in ref)


def test_tokenizer_and_chat_template_files_are_copied(converted):
    for algo in ("W4A16_NVFP4", "drafter"):
        _, out = converted[algo]
        srcdir = out.parent / f"src-{algo}"
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "generation_config.json"):
            assert (out / f).read_bytes() == (srcdir / f).read_bytes()
        assert not (out / "README.md").exists() and not (out / "hf_quant_config.json").exists()


def test_output_is_a_valid_safetensors_file_for_the_reference_library(converted):
    _, out = converted["MIXED_PRECISION"]
    blob = (out / "model.safetensors").read_bytes()
    entries = dict(safetensors.deserialize(blob))
    w = load_out(out)
    assert set(entries) == set(w)
    for k, v in entries.items():
        assert bytes(v["data"]) == out_bytes(w[k]), k
    with safetensors.safe_open(str(out / "model.safetensors"), "numpy") as f:
        assert f.metadata() == {"format": "mlx"}
        np.testing.assert_array_equal(f.get_tensor("backbone.layers.1.mixer.experts.up_proj.scales"),
                                      np.array(w["backbone.layers.1.mixer.experts.up_proj.scales"]))


def test_drafter_keeps_nvidia_names_and_detects_its_kind(converted, tmp_path):
    src, out = converted["drafter"]
    w = load_out(out)
    assert {"fc.weight", "fc.scales", "fc.weight_scale_2", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.scales", "embed_tokens.weight",
            "layers.1.self_attn.attention_sink_bias"} <= set(w)
    receipt = json.loads((out / "MERERUN_CONVERSION.json").read_text())
    assert receipt["model_kind"] == "drafter"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["modules"]["fc"] == "nvfp4"
    assert cfg["quantization"]["modules"]["layers.0.self_attn.q_proj"] == "bf16"
    # an export that wraps the same module tree as "model.*" converts to the same names
    synth_drafter(tmp_path / "src", prefix="model.")
    out2 = convert(str(tmp_path / "src"), tmp_path / "o", progress=False)
    assert (out2 / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_runtime_layers_compute_with_the_converted_layout(converted):
    src, out = converted["MIXED_PRECISION"]
    w = load_out(out)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for p, src_p in [("backbone.layers.1.mixer.shared_experts.up_proj",) * 2,
                     ("backbone.layers.0.mixer.in_proj",) * 2]:
        layer = make_linear(w, p, dtype=mx.float32)
        got = np.array(layer(mx.array(x)))
        wt = src[f"{src_p}.weight"]
        if wt[0] == "U8":
            sc = src[f"{src_p}.weight_scale"]
            dq = nvfp4_dequantize(np.frombuffer(wt[2], np.uint8).reshape(wt[1]),
                                  np.frombuffer(sc[2], np.uint8).reshape(sc[1]),
                                  np.frombuffer(src[f"{src_p}.weight_scale_2"][2], np.float32)[0])
        else:
            dq = E4M3[np.frombuffer(wt[2], np.uint8).reshape(wt[1])] * \
                np.frombuffer(src[f"{src_p}.weight_scale"][2], np.float32)[0]
        ref = x.astype(np.float64) @ dq.astype(np.float64).T
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_progress_bar_counts_every_tensor_byte_on_stderr(tmp_path, capsys):
    synth_drafter(tmp_path / "src")
    out = convert(str(tmp_path / "src"), tmp_path / "o", progress=True)
    err = capsys.readouterr().err
    total = sum(v.nbytes for v in load_out(out).values())
    from tqdm import tqdm
    assert "convert: 100%" in err
    assert f"{tqdm.format_sizeof(total, divisor=1024)}/{tqdm.format_sizeof(total, divisor=1024)}" in err


def test_the_cli_keeps_mtp_by_default_drops_it_with_no_mtp_and_still_takes_keep_mtp(tmp_path):
    from mlx_dspark import cli
    synth_target(tmp_path / "src", "W4A16_NVFP4")
    for flags, kept in (([], True), (["--no-mtp"], False), (["--keep-mtp"], True)):
        out = tmp_path / f"out{len(flags)}{kept}"
        assert cli.main(["convert", str(tmp_path / "src"), "-o", str(out), "--no-progress",
                         *flags]) == 0
        assert any(k.startswith("mtp.") for k in load_out(out)) == kept
