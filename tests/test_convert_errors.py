"""Bad input: each case is refused with one line naming the file and the problem, a non-zero
exit from the real CLI entry point, no traceback, and no output directory left behind."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testkit.synthetic import synth_drafter, synth_target
from mlx_dspark.cli import main

M = "backbone.layers.0.mixer.in_proj"          # an NVFP4 module in W4A16_NVFP4 sources


def _set(name, value):
    return lambda t, c, q: t.__setitem__(name, value)


def _pop(*names):
    return lambda t, c, q: [t.pop(n) for n in names]


def _scale_as(dtype, shape, nbytes_per=1):
    return _set(f"{M}.weight_scale", (dtype, shape, b"\x01" * (int(np.prod(shape)) * nbytes_per)))


def _in_not_multiple_of_16(t, c, q):
    t[f"{M}.weight"] = ("U8", (196, 20), bytes(196 * 20))          # in = 40
    t[f"{M}.weight_scale"] = ("F8_E4M3", (196, 3), bytes(196 * 3))


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _trailing(path):
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)


def _corrupt_json(path):
    f = path / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[8:20] = b"{not json!!!"
    f.write_bytes(bytes(b))


def _huge_header(path):
    f = path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])


def _overlap(path):
    f = path / "model.safetensors"
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))


def _header_dtype_shape_mismatch(t, c, q):
    dtype, shape, data = t[f"{M}.weight_scale_2"]
    t[f"{M}.weight_scale_2"] = ("F32", (2,), data)                 # 2 floats claimed, 4 bytes given


def _quant_algo(algo):
    def edit(t, c, q):
        q["quant_algo"] = algo
        c["quantization_config"]["quant_algo"] = algo
    return edit


def _exclude_quantized_module(t, c, q):
    q["exclude_modules"].append(M)


def _rm(name):
    return lambda path: (path / name).unlink()


# id -> (source builder, algo, edit before writing, change after writing, expected words, file)
CASES = {
    "missing config.json": ("target", "W4A16_NVFP4", None, _rm("config.json"),
                            "missing file", "config.json"),
    "missing shard": ("target-sharded", "W4A16_NVFP4", None, _rm("model-00002-of-00002.safetensors"),
                      "missing file", "model-00002-of-00002.safetensors"),
    "truncated safetensors": ("target", "W4A16_NVFP4", None, _truncate, "truncated",
                              "model.safetensors"),
    "trailing bytes": ("target", "W4A16_NVFP4", None, _trailing, "trailing bytes",
                       "model.safetensors"),
    "corrupt header json": ("target", "W4A16_NVFP4", None, _corrupt_json,
                            "corrupt safetensors header", "model.safetensors"),
    "corrupt header length": ("target", "W4A16_NVFP4", None, _huge_header,
                              "corrupt safetensors header", "model.safetensors"),
    "overlapping tensors": ("target", "W4A16_NVFP4", None, _overlap, "overlaps",
                            "model.safetensors"),
    "header dtype/shape mismatch": ("target", "W4A16_NVFP4", _header_dtype_shape_mismatch, None,
                                    "needs 8 bytes", "model.safetensors"),
    "missing block scale": ("target", "W4A16_NVFP4", _pop(f"{M}.weight_scale"), None,
                            "without its block scale", "model.safetensors"),
    "missing tensor scale": ("target", "NVFP4", _pop(f"{M}.weight_scale_2"), None,
                             "without its tensor scale", "model.safetensors"),
    "missing fp8 scale": ("target", "FP8", _pop(f"{M}.weight_scale"), None,
                          "FP8 weight without its scale", "model.safetensors"),
    "scale without weight": ("target", "W4A16_NVFP4", _pop(f"{M}.weight"), None,
                             "scale without its weight", "model.safetensors"),
    "block scale wrong dtype": ("target", "W4A16_NVFP4", _scale_as("BF16", (196, 4), 2), None,
                                "must be F8_E4M3", "model.safetensors"),
    "tensor scale wrong dtype": ("target", "W4A16_NVFP4",
                                 _set(f"{M}.weight_scale_2", ("BF16", (), b"\0\0")), None,
                                 "float32 scalar", "model.safetensors"),
    "dense weight with scales": ("target", "W4A16_NVFP4",
                                 _set(f"{M}.weight", ("BF16", (196, 64), bytes(196 * 64 * 2))),
                                 None, "expected U8", "model.safetensors"),
    "block scale wrong shape": ("target", "W4A16_NVFP4", _scale_as("F8_E4M3", (196, 3)), None,
                                "block scale shape [196, 3] != [196, 4]", "model.safetensors"),
    "in not a multiple of 16": ("target", "W4A16_NVFP4", _in_not_multiple_of_16, None,
                                "not a multiple of 16", "model.safetensors"),
    "swizzled 1-D scales": ("target", "W4A16_NVFP4", _scale_as("F8_E4M3", (196 * 4,)), None,
                            "swizzled (1-D)", "model.safetensors"),
    "128-row padded scales": ("target", "W4A16_NVFP4", _scale_as("F8_E4M3", (256, 4)), None,
                              "padded to 128", "model.safetensors"),
    "unsupported quant_algo": ("target", "W4A16_NVFP4", _quant_algo("W4A8_AWQ"), None,
                               "unsupported quant_algo 'W4A8_AWQ'", "hf_quant_config.json"),
    "unsupported mixed entry": ("target", "MIXED_PRECISION",
                                lambda t, c, q: q["quantized_layers"][M].update(quant_algo="INT4_AWQ"),
                                None, "unsupported quant_algo 'INT4_AWQ'", "hf_quant_config.json"),
    "awq pre_quant_scale": ("target", "W4A16_NVFP4",
                            _set(f"{M}.pre_quant_scale", ("BF16", (64,), bytes(128))), None,
                            "AWQ/SVDQuant", "model.safetensors"),
    "svdquant lora": ("target", "W4A16_NVFP4",
                      _set(f"{M}.svdquant_lora_a", ("BF16", (8, 64), bytes(1024))), None,
                      "AWQ/SVDQuant", "model.safetensors"),
    "config contradicts tensors": ("target", "W4A16_NVFP4", _exclude_quantized_module, None,
                                   "tensors are nvfp4 but hf_quant_config.json says unquantized",
                                   "model.safetensors"),
    "mixed layer not listed": ("target", "MIXED_PRECISION",
                               lambda t, c, q: q["quantized_layers"].pop(M), None,
                               "says unquantized", "model.safetensors"),
    "missing expert": ("target", "W4A16_NVFP4",
                       _pop(*[f"backbone.layers.1.mixer.experts.2.{p}.{s}"
                              for p in ("up_proj", "down_proj")
                              for s in ("weight", "weight_scale", "weight_scale_2")]),
                       None, "missing [2]", "model.safetensors"),
    "unknown model": ("drafter", None,
                      lambda t, c, q: (c.update(architectures=["LlamaForCausalLM"]),
                                       t.pop("fc.weight"), t.pop("fc.weight_scale"),
                                       t.pop("fc.weight_scale_2")),
                      None, "unsupported model", "config.json"),
    "pattern contradicts block types": ("target", "W4A16_NVFP4",
                                        lambda t, c, q: c.update(hybrid_override_pattern="MMM*E"),
                                        None, "contradicts layers_block_type", "config.json"),
    "pattern length": ("target", "W4A16_NVFP4", lambda t, c, q: c.update(num_hidden_layers=7),
                       None, "num_hidden_layers is 7", "config.json"),
    "drafter unsupported method": ("drafter", None,
                                   lambda t, c, q: q.update(quant_method="awq"), None,
                                   "unsupported quant_method 'awq'", "config.json"),
}


def build(kind, algo, edit, post, path):
    if kind == "drafter":
        synth_drafter(path, edit=edit)
    else:
        synth_target(path, algo, shards=2 if kind == "target-sharded" else 1, edit=edit)
    if post is not None:
        post(path)


def assert_refused(rc, err, out: Path, *words):
    lines = err.strip().splitlines()
    assert rc == 1
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_with_one_line_and_no_output(case, tmp_path, capsys):
    kind, algo, edit, post, words, fname = CASES[case]
    build(kind, algo, edit, post, tmp_path / "src")
    out = tmp_path / "out"
    rc = main(["convert", str(tmp_path / "src"), "-o", str(out), "--no-progress"])
    assert_refused(rc, capsys.readouterr().err, out, words, fname, "mlx-dspark convert: error:")


def test_missing_source_directory_is_refused(tmp_path, capsys):
    rc = main(["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "out")])
    assert_refused(rc, capsys.readouterr().err, tmp_path / "out", "no such directory", "nope")


def test_existing_output_is_refused_unless_force(tmp_path, capsys):
    synth_target(tmp_path / "src", "W4A16_NVFP4")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "src"), "-o", str(out)]) == 0
    first = (out / "model.safetensors").read_bytes()
    (out / "stale.txt").write_text("from an older conversion")
    capsys.readouterr()
    rc = main(["convert", str(tmp_path / "src"), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "already exists (pass --force" in err and str(out) in err
    assert (out / "stale.txt").exists()                          # untouched
    # a file the receipt does not list is not ours to delete, even with --force
    rc = main(["convert", str(tmp_path / "src"), "-o", str(out), "--force"])
    err = capsys.readouterr().err
    assert rc == 1 and "'stale.txt' is not listed in its MERERUN_CONVERSION.json" in err
    assert (out / "stale.txt").exists()
    (out / "stale.txt").unlink()
    (out / "model.safetensors").write_bytes(b"older bytes")     # same files: a conversion
    assert main(["convert", str(tmp_path / "src"), "-o", str(out), "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() == first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_force_never_replaces_a_directory_that_is_not_a_conversion(tmp_path, capsys):
    synth_target(tmp_path / "src", "W4A16_NVFP4")
    other = tmp_path / "home"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    rc = main(["convert", str(tmp_path / "src"), "-o", str(other), "--force"])
    err = capsys.readouterr().err
    assert rc == 1 and "not a converted checkpoint" in err
    assert (other / "precious.txt").read_text() == "keep me"


def test_cli_module_entry_point_exits_non_zero_without_traceback(tmp_path):
    build("target", "W4A16_NVFP4", None, _truncate, tmp_path / "src")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "mlx_dspark.cli", "convert", str(tmp_path / "src"),
                        "-o", str(out)], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1
    assert_refused(r.returncode, r.stderr, out, "truncated", "model.safetensors")
