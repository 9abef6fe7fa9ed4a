"""What is checked is what is loaded (issue 43, item 3): a weight file swapped after the
check and before the read is caught, because the hashes are taken of the very bytes the
tensors are made from, for a receipt (checkpoint/integrity.py) and for the hashes recorded at
a first load (checkpoint/recorded.py); the swap is put in that window on purpose by a hook,
not by timing. A record store that other users can write, or that another user owns, is
refused, as the disk prompt cache refuses its directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint import recorded
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.models import nemotron_h
from testkit.mlx_lm_layouts import dense_hf


def swapped_after_the_check(monkeypatch, f: Path):
    """Once the load's check of its files returns, ``f`` is replaced by a copy with one data
    byte changed (a new file renamed over it, as a swap is done)."""
    check = nemotron_h.check_files

    def then_swap(*args, **kwargs):
        out = check(*args, **kwargs)
        data = bytearray(f.read_bytes())
        data[-2] ^= 0x01        # a low mantissa bit of the last tensor: a change, never an inf
        tmp = f.with_name(".swap")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, f)
        return out

    monkeypatch.setattr(nemotron_h, "check_files", then_swap)


@pytest.mark.parametrize("verify", ["full", "fast"])
def test_a_weight_file_swapped_after_the_receipt_check_is_refused(verify, tmp_path,
                                                                  monkeypatch):
    path = shutil.copytree(DEMO / "target", tmp_path / "target")
    f = path / "model.safetensors"
    swapped_after_the_check(monkeypatch, f)
    # fast: the file's last block is always among those checked
    with pytest.raises(CheckpointError, match=rf"^{f}: block \d+ .* differs from the "
                                              rf"conversion receipt"):
        md.load(str(path), drafter=None, verify=verify)


@pytest.fixture
def hf(tmp_path):
    return dense_hf(DEMO / "target", tmp_path / "hf", dtype=mx.bfloat16, mtp=False)


def test_a_weight_file_swapped_after_the_recorded_check_is_refused(hf, monkeypatch):
    first = md.generate(md.load(str(hf), drafter=None), [5, 6], max_tokens=3).tokens
    assert recorded.record_file(hf).is_file()
    f = hf / "model.safetensors"
    swapped_after_the_check(monkeypatch, f)
    with pytest.raises(CheckpointError, match=rf"^{f}: .* differs from the hashes recorded at "
                                              rf"its first load"):
        md.load(str(hf), drafter=None)
    assert first


def test_a_first_load_records_the_bytes_it_loaded(hf, monkeypatch):
    # swapped between the first load's look at the directory and its read: the record holds
    # what was loaded, so the next load (of the same, swapped, file) agrees with it
    swapped_after_the_check(monkeypatch, hf / "model.safetensors")
    loaded = md.load(str(hf), drafter=None)
    monkeypatch.undo()
    again = md.load(str(hf), drafter=None)
    assert mx.array_equal(loaded.target.lm_head(mx.ones((1, 192))),
                          again.target.lm_head(mx.ones((1, 192)))).item()


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another user's"])
def test_a_record_store_others_can_write_is_refused(how, hf, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    md.load(str(hf), drafter=None)                      # the first load records
    store = recorded.record_file(hf).parent
    if how == "another user's":
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(store, 12345, 12345)
    else:
        store.chmod(0o770 if how == "group-writable" else 0o777)
    with pytest.raises(CheckpointError) as e:
        md.load(str(hf), drafter=None)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{store}: the store of recorded hashes is "
                                                f"not to be trusted"), text
    assert ("belongs to another user" if how == "another user's"
            else "can be written by other users") in text
