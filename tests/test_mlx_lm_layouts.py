"""mlx-lm's Nemotron-H layout as a target format (issue 31): what ``mlx_lm.convert`` writes from
the demo target's dense weights, in this run, at every precision it has (testing/
mlx_lm_layouts.FORMATS), loads as it is and computes what mlx-lm's own ``nemotron_h`` computes
on the same files (float32 logits within 1e-5 relative, greedy tokens equal); DSpark and
EAGLE-3 speculate losslessly on each; the unconverted dense Hugging Face directory (with its
MTP block) takes every drafter, ``--drafter mtp`` included; a directory without a receipt is
checked against the hashes recorded at its first load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.checkpoint.recorded import record_file, verify_directory
from mlx_dspark.open_files import import_mlx_lm
from testkit.mlx_lm_layouts import FORMATS, make_all, mlx_lm_greedy

mlx_lm_utils = import_mlx_lm("mlx_lm.utils")
PROMPT = [1, 281, 1092, 44, 17, 3002, 9, 511, 77, 12, 1800, 33, 5, 640, 2048, 91, 7, 300, 4001, 15]
LAYOUTS = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "affine-4bit": "affine 4-bit (group 64)",
           "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """The dense HF source and each of FORMATS, converted by mlx-lm now."""
    return make_all(tmp_path_factory.mktemp("mlx-lm-layouts"), DEMO / "target")


@pytest.fixture(scope="session")
def oracles(made):
    """mlx-lm's own model on each directory, in float32."""
    out = {}
    for name, path in made.items():
        model, _ = mlx_lm_utils.load_model(Path(path))
        model.set_dtype(mx.float32)
        out[name] = model
    return out


def _rel(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize("name", ["hf-fp32", *FORMATS])
def test_logits_and_greedy_tokens_equal_mlx_lm_on_the_same_files(made, oracles, name):
    target = md.load_target(str(made[name]), dtype="float32")
    ref = oracles[name]
    for ids in (PROMPT, PROMPT[:5]):            # the chunked scan, and the serial one
        assert _rel(target(mx.array([ids])), ref(mx.array([ids]))) < 1e-5
    pair = md.load(str(made[name]), dtype="float32", warm=False)
    assert md.generate(pair, PROMPT, max_tokens=12).tokens == mlx_lm_greedy(ref, PROMPT, 12)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_layout_is_named_with_its_precision(made, name):
    target = md.load_target(str(made[name]), dtype="float32")
    assert str(target.format) == f"mlx-lm's layout, {LAYOUTS[name]}"
    mixed = md.load_target(str(made["mixed-3-6"]), dtype="float32").format
    assert "per-module affine 3-bit (group 64) and affine 6-bit (group 64)" in mixed.precision


FAST = ("bf16", "affine-4bit", "nvfp4")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in FORMATS])
@pytest.mark.parametrize("drafter", ["drafter", "eagle3"])
def test_speculation_is_lossless_on_each_format(made, name, drafter):
    pair = md.load(str(made[name]), str(DEMO / drafter), dtype="float32", warm=False)
    serial = md.generate(pair, PROMPT, max_tokens=20, speculative="off")
    spec = md.generate(pair, PROMPT, max_tokens=20, speculative="on", num_draft=3)
    assert spec.tokens == serial.tokens and spec.stats.rounds > 0


def test_the_unconverted_hf_directory_takes_every_drafter_mtp_included(made):
    for drafter in ("mtp", str(DEMO / "drafter"), str(DEMO / "eagle3")):
        pair = md.load(str(made["hf-fp32"]), drafter, dtype="float32", warm=False)
        serial = md.generate(pair, PROMPT, max_tokens=20, speculative="off")
        spec = md.generate(pair, PROMPT, max_tokens=20, speculative="on", num_draft=3)
        assert spec.tokens == serial.tokens and spec.stats.accepted > 0
    assert pair.drafter_note == f"with the EAGLE-3 drafter {DEMO / 'eagle3'}"
    assert md.load(str(made["hf-fp32"]), "mtp", warm=False).drafter.gate_report.endswith(
        "tensors match")


def test_mtp_on_mlx_lm_s_layout_is_one_line_naming_what_to_use(made):
    with pytest.raises(CheckpointError) as e:
        md.load(str(made["affine-4bit"]), "mtp", warm=False)
    assert "mlx_lm.convert drops mtp.*" in str(e.value) and "\n" not in str(e.value)
    assert "use a DSpark or EAGLE-3 drafter" in str(e.value)


def test_a_tensor_no_module_takes_is_refused(made, tmp_path):
    import shutil
    bad = tmp_path / "extra"
    shutil.copytree(made["affine-4bit"], bad)
    w = mx.load(str(bad / "model.safetensors"))
    w["backbone.layers.1.mixer.stray_proj.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(bad / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match="mlx-lm's Nemotron-H does not have: "
                                              "backbone.layers.1.mixer.stray_proj.weight"):
        md.load_target(str(bad))


def test_hashes_are_recorded_at_the_first_load_outside_the_directory_and_checked_after(
        made, tmp_path, monkeypatch):
    import shutil
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(made["affine-8bit"], model)
    before = sorted(os.listdir(model))
    md.load_target(str(model))
    assert sorted(os.listdir(model)) == before          # nothing written into the model
    record = json.loads(record_file(model).read_text())
    assert record_file(model).parent == tmp_path / "cache" / "recorded"
    assert set(record["outputs"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    md.load_target(str(model), verify="full")          # checked, passes
    assert verify_directory(str(model)).startswith(f"{model}: intact: ")

    raw = bytearray((model / "model.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (model / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        md.load_target(str(model), verify="full")
    assert "differs from the hashes recorded at its first load" in str(e.value)
    assert f"delete {record_file(model)}" in str(e.value)
    with pytest.raises(CheckpointError, match="recorded at its first load"):
        verify_directory(str(model))
    md.load_target(str(model), verify="none")          # the explicit opt-out still loads
    mx.save_safetensors(str(model / "model-00002-of-00002.safetensors"), {"x": mx.zeros(2)})
    with pytest.raises(CheckpointError, match="not there at its first load"):
        md.load_target(str(model))


def test_verify_records_a_directory_it_has_not_seen(made, tmp_path, monkeypatch, capsys):
    from mlx_dspark import cli
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    path = str(made["nvfp4"])
    assert cli.main(["verify", path]) == 0
    assert "hashes are recorded now" in capsys.readouterr().out
    assert cli.main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: intact: ")


def test_disk_snapshots_are_keyed_by_the_recorded_hashes(made, tmp_path):
    pair = md.load(str(made["affine-4bit"]), dtype="float32", warm=False,
                   prompt_cache_dir=str(tmp_path / "snapshots"))
    assert pair.receipts[0] is not None and pair.prompt_cache is not None
    again = md.load(str(made["affine-4bit"]), dtype="float32", warm=False)
    assert again.receipts[0] == pair.receipts[0]


def test_the_memory_pre_flight_counts_mlx_lm_s_layout(made):
    from mlx_dspark.checkpoint.memory import weight_bytes
    for name in ("bf16", "affine-4bit", "nvfp4"):
        mx.clear_cache()
        before = mx.get_active_memory()
        target = md.load_target(str(made[name]), dtype="float32")
        held = mx.get_active_memory() - before
        estimate, _ = weight_bytes(str(made[name]), mx.float32)
        assert 0.8 * held <= estimate <= 1.25 * held, (name, estimate, held)
        del target
