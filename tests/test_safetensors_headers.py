"""safetensors headers checked whole (issue 43, item 2): a tensor whose ``data_offsets``
overlap another's (one aliasing the other's bytes), a tensor named twice (a repeated JSON
key, where the last entry wins) and bytes outside any tensor are refused, naming the file and
the tensors, by the loader (``md.load``, before MLX sees the file) and by ``convert``."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import mlx_dspark as md
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.converter import convert
from mlx_dspark.converter.errors import ConversionError

MODELOPT = Path(__file__).parent / "fixtures" / "modelopt" / "target_bf16"


def parts(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(f: Path, header_text: str, data: bytes) -> None:
    head = header_text.encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + data)


def same_shape_pair(header: dict) -> tuple[str, str]:
    """Two tensors of one dtype and shape (the second may alias the first's bytes)."""
    seen = {}
    for name, t in sorted(header.items()):
        if name == "__metadata__":
            continue
        key = (t["dtype"], tuple(t["shape"]))
        if key in seen and t["data_offsets"][1] > t["data_offsets"][0]:
            return seen[key], name
        seen[key] = name
    raise AssertionError("no two tensors alike")


def overlapping(f: Path) -> str:
    header, data = parts(f)
    a, b = same_shape_pair(header)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    write(f, json.dumps(header), data)
    return f"tensor {b!r} overlaps tensor {a!r}"


def named_twice(f: Path) -> str:
    header, data = parts(f)
    a, b = same_shape_pair(header)
    text = json.dumps(header)                  # then a's name again, over b's bytes: last wins
    text = text[:-1] + f", {json.dumps(a)}: {json.dumps(header[b])}}}"
    write(f, text, data)
    return f"duplicate key {a!r}"


def trailing(f: Path) -> str:
    header, data = parts(f)
    write(f, json.dumps(header), data + bytes(16))
    return "16 trailing bytes after the last tensor"


def gap(f: Path) -> str:
    header, data = parts(f)
    first = min((t["data_offsets"][0], n) for n, t in header.items() if n != "__metadata__")[1]
    end = header[first]["data_offsets"][1]
    for name, t in header.items():
        if name != "__metadata__" and t["data_offsets"][0] >= end and name != first:
            t["data_offsets"] = [o + 8 for o in t["data_offsets"]]
    write(f, json.dumps(header), data[:end] + bytes(8) + data[end:])
    return f"data bytes {end}-{end + 7} belong to no tensor"


WAYS = {"overlapping offsets": overlapping, "a tensor named twice": named_twice,
        "trailing bytes": trailing, "a gap between tensors": gap}


@pytest.mark.parametrize("way", WAYS)
def test_the_loader_refuses_a_header_that_is_not_whole_naming_file_and_tensors(way, tmp_path):
    path = shutil.copytree(DEMO / "target", tmp_path / "target")
    f = path / "model.safetensors"
    words = WAYS[way](f)
    with pytest.raises(CheckpointError) as e:
        md.load(str(path), drafter=None, verify="none")   # no receipt to catch it first
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{f}: ") and words in text, text


@pytest.mark.parametrize("way", WAYS)
def test_convert_refuses_a_header_that_is_not_whole_naming_file_and_tensors(way, tmp_path):
    src = shutil.copytree(MODELOPT, tmp_path / "src")
    f = src / "model.safetensors"
    words = WAYS[way](f)
    with pytest.raises(ConversionError) as e:
        convert(str(src), tmp_path / "out", progress=False)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{f}: ") and words in text, text
    assert not (tmp_path / "out").exists()


def test_the_weight_gate_reads_headers_as_strictly_as_the_loader(tmp_path):
    from mlx_dspark.models.weights import read_raw_safetensors
    path = shutil.copytree(DEMO / "drafter", tmp_path / "drafter")
    f = path / "model.safetensors"
    words = named_twice(f)
    with pytest.raises(CheckpointError, match=words):
        read_raw_safetensors(str(f))
