"""Load checks what it loads (issue 11, item 3): both checkpoints against their receipts at the
level asked for, only the weight files the receipt lists, no globbing of user paths, a
receipt required, ``mlx-dspark verify``, and a tokenizer that runs no checkpoint code and fits
the model's vocabulary. On the embedded demo pair and the tiny drafter fixture."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures.drafter import tiny

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.checkpoint import integrity
from mlx_dspark.api import DEMO
from mlx_dspark.converter.layout import BlockHash
from mlx_dspark.drafters import load_drafter
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.models.nemotron_h import load_target
from mlx_dspark.text.tokenizer import load_tokenizer

RECEIPT = "MERERUN_CONVERSION.json"


@pytest.fixture
def demo(tmp_path):
    """A copy of the demo pair (target/ and drafter/) that a test may damage."""
    shutil.copytree(DEMO / "target", tmp_path / "target")
    shutil.copytree(DEMO / "drafter", tmp_path / "drafter")
    return tmp_path


def flip(path: Path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def small_block_receipt(directory: Path, block: int):
    """Rewrite the receipt's weight-file blocks at ``block`` bytes (a multi-block file from a
    small fixture), computed with hashlib over slices, not with BlockHash."""
    doc = json.loads((directory / RECEIPT).read_text())
    data = (directory / "model.safetensors").read_bytes()
    doc["outputs"]["model.safetensors"]["blocks"] = {"size": block, "sha256": [
        hashlib.sha256(data[i:i + block]).hexdigest() for i in range(0, len(data), block)]}
    (directory / RECEIPT).write_text(json.dumps(doc))


def test_block_hash_matches_hashlib_over_each_block_fed_in_any_pieces():
    data = np.random.default_rng(0).integers(0, 256, 10_000, np.uint8).tobytes()
    h = BlockHash(block_bytes=4096)
    for a, b in [(0, 1), (1, 5000), (5000, 8192), (8192, 8193), (8193, 10_000)]:
        h.update(memoryview(data)[a:b])
    assert h.blocks() == {"size": 4096, "sha256": [hashlib.sha256(data[i:i + 4096]).hexdigest()
                                                   for i in (0, 4096, 8192)]}


def test_demo_receipts_record_blocks_of_the_shipped_weights():
    for kind in ("target", "drafter"):
        entry = json.loads((DEMO / kind / RECEIPT).read_text())["outputs"]["model.safetensors"]
        data = (DEMO / kind / "model.safetensors").read_bytes()
        assert entry["blocks"] == {"size": 16 << 20, "sha256": [hashlib.sha256(data).hexdigest()]}


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_converted_directory_without_receipt_is_refused_unless_verify_none(demo, kind):
    (demo / kind / RECEIPT).unlink()
    with pytest.raises(CheckpointError, match=rf"{kind}: no conversion receipt .*verify=\"none\""):
        md.load(demo / "target", demo / "drafter")
    pair = md.load(demo / "target", demo / "drafter", verify="none")
    assert pair.drafter is not None


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_zeroed_weight_bytes_are_refused_by_default_in_a_small_checkpoint(demo, kind):
    f = demo / kind / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*differs from the "
                                              r"conversion receipt.*changed after conversion"):
        md.load(demo / "target", demo / "drafter")


def test_fast_level_checks_sizes_header_and_last_block_and_samples_the_rest(tmp_path,
                                                                             monkeypatch):
    path = tmp_path / "drafter"
    shutil.copytree(tiny.DRAFTER, path)
    small_block_receipt(path, 4096)                   # 31 blocks
    checked = []
    span = integrity._check_span
    monkeypatch.setattr(integrity, "_check_span", lambda job: checked.append(job) or span(job))
    reading = integrity.Reading.__init__              # weight files: checked as they are read
    monkeypatch.setattr(integrity.Reading, "__init__", lambda self, f, spans, words:
                        checked.extend(spans) or reading(self, f, spans, words))
    load_drafter(str(path), tiny.ArrayTarget(), verify="fast")
    blocks = sorted(j[4] for j in checked if j[4] is not None)
    header = -(-(8 + int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little"))
               // 4096)
    assert blocks[:header] == list(range(header)) and blocks[-1] == 30
    assert len(blocks) == header + 1 + integrity.FAST_SAMPLES
    assert [j[0] for j in checked if j[4] is None] == [str(path / "config.json")]

    weights = path / "model.safetensors"
    flip(weights, 20)                                 # in the header: always checked
    with pytest.raises(CheckpointError, match=r"block 0 \(bytes 0-4095\) sha256"):
        load_drafter(str(path), tiny.ArrayTarget(), verify="fast")
    flip(weights, 20)
    flip(weights, 15 * 4096 + 7)                      # mid-file: full always finds it
    with pytest.raises(CheckpointError, match=r"block 15 \(bytes 61440-65535\)"):
        load_drafter(str(path), tiny.ArrayTarget(), verify="full")
    flip(weights, 15 * 4096 + 7)
    with open(weights, "ab") as fh:                   # a size change: every level but none
        fh.write(b"\0")
    with pytest.raises(CheckpointError, match="125272 bytes, the conversion receipt records "
                                              "125271"):
        load_drafter(str(path), tiny.ArrayTarget(), verify="fast")


def test_stray_extra_safetensors_never_overrides_tensors(demo):
    good = md.load(demo / "target", verify="none").target
    w = mx.load(str(demo / "target" / "model.safetensors"))
    name = "backbone.norm_f.weight"
    mx.save_safetensors(str(demo / "target" / "extra.safetensors"), {name: w[name] * 0 + 7})
    mx.save_safetensors(str(demo / "target" / "model-extra.safetensors"),
                        {name: w[name] * 0 + 9})
    loaded = md.load(demo / "target").target
    assert mx.array_equal(loaded.norm_f, good.norm_f).item()
    # Without a receipt, the directory's model*.safetensors are read: a duplicate is refused.
    (demo / "target" / RECEIPT).unlink()
    with pytest.raises(CheckpointError, match=f"tensor {name} is also in"):
        md.load(demo / "target", verify="none")


def test_model_path_is_not_a_glob_pattern(tmp_path):
    shutil.copytree(DEMO / "target", tmp_path / "m*")
    shutil.copytree(DEMO / "target", tmp_path / "mz")       # a sibling the pattern would match
    w = mx.load(str(tmp_path / "mz" / "model.safetensors"))
    w["backbone.norm_f.weight"] = w["backbone.norm_f.weight"] * 0 + 3
    mx.save_safetensors(str(tmp_path / "mz" / "model.safetensors"), w)
    target = load_target(str(tmp_path / "m*"))
    assert not mx.array_equal(target.norm_f, w["backbone.norm_f.weight"]).item()


@pytest.mark.parametrize("outputs, message", [
    ([], r"\"outputs\" must be a non-empty object"),
    ({"model.safetensors": {"size": "125271", "sha256": "0" * 64}}, "size must be a non-negative"),
    ({"model.safetensors": {"size": 1, "sha256": None}}, "sha256 must be 64 lowercase hex"),
    ({"../model.safetensors": {"size": 1, "sha256": "0" * 64}}, "is not a file name"),
    ({"model.safetensors": {"size": 1, "sha256": "0" * 64, "blocks": {"size": 0}}},
     "blocks must be"),
])
def test_malformed_receipt_is_one_line_naming_it(demo, capsys, outputs, message):
    (demo / "target" / RECEIPT).write_text(json.dumps({"outputs": outputs}))
    assert cli.main(["generate", "--model", str(demo / "target"), "-p", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"target/{RECEIPT}: malformed receipt" in err and re.search(message, err), err


def test_verify_command_reports_intact_or_names_the_changed_file(demo, capsys):
    assert cli.main(["verify", str(demo / "target")]) == 0
    out = capsys.readouterr().out
    assert out == f"{demo / 'target'}: intact: 6 files, 7.3 MB match the conversion receipt (SHA-256)\n"
    flip(demo / "target" / "tokenizer.json", 100)
    assert cli.main(["verify", str(demo / "target")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mlx-dspark verify: error: {demo / 'target' / 'tokenizer.json'}: "
                          f"sha256 ") and "differs from the conversion receipt" in err


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(demo):
    # a config saying 4000 is refused before (its embedding has 4096 rows): a model of 4000
    with pytest.raises(ValueError, match="tokenizer has ids up to 4095 but the model's "
                                         "vocab_size is 4000"):
        load_tokenizer(demo / "target", 4000)


def test_tokenizer_asking_for_remote_code_is_refused_without_running_it_or_prompting(
        demo, capfd):
    t = demo / "target"
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer",
               auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = demo / "EXECUTED"
    (t / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                               "from transformers import PreTrainedTokenizerFast\n"
                               "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(ValueError, match="needs code shipped with the checkpoint .*never runs"):
        md.load(t, verify="none")
    out, err = capfd.readouterr()
    assert not marker.exists() and "[y/N]" not in out + err


def test_fast_level_hashes_in_full_a_file_whose_receipt_predates_blocks(demo):
    receipt = demo / "target" / RECEIPT
    doc = json.loads(receipt.read_text())
    del doc["outputs"]["model.safetensors"]["blocks"]
    receipt.write_text(json.dumps(doc))
    flip(demo / "target" / "model.safetensors", 3_000_000)
    with pytest.raises(CheckpointError, match=r"model.safetensors: sha256 .* differs from the "
                                              r"conversion receipt"):
        load_target(str(demo / "target"), verify="fast")


def test_a_receipt_that_is_a_fifo_is_one_line_instead_of_a_hang(demo, capsys):
    receipt = demo / "target" / RECEIPT
    receipt.unlink()
    os.mkfifo(receipt)
    assert cli.main(["verify", str(demo / "target")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a regular file" in err, err
