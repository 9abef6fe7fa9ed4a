"""Issue 41.6, checks before weights: a missing tokenizer, a drafter built for another target
and a config that cannot run are named before any weight is read (they came after an 18-30 s
load of a 2.7 GB checkpoint). Counted, not timed: every Python ``open`` of a safetensors file
(the receipt's hashing, the memory pre-flight) through an audit hook, but for reading its
header alone (the config's shapes checked against the tensors come first), and every
``mx.load`` (MLX reads the weights in C++, past the hook)."""

from __future__ import annotations

import json
import shutil
import sys

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import api, cli
from mlx_dspark.drafters.base import DrafterError

_OPENED: list | None = None           # while a test records: the safetensors files opened


def _audit(event, args):
    if _OPENED is not None and event == "open" and str(args[0]).endswith(".safetensors") \
            and not _reading_header():
        _OPENED.append(str(args[0]))


def _reading_header() -> bool:
    """Whether the open comes from reading a safetensors header alone (converter/
    safetensors_io.read_header: the config's shapes checked against the tensors, issue 43),
    which reads no weight."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "read_header" and \
                frame.f_code.co_filename.endswith("safetensors_io.py"):
            return True
        frame = frame.f_back
    return False


sys.addaudithook(_audit)


@pytest.fixture
def reads(monkeypatch):
    """Every safetensors file opened and every ``mx.load`` from now until the test ends."""
    global _OPENED
    _OPENED = opened = []
    real = mx.load

    def load(*args, **kw):
        opened.append(f"mx.load {args[0]}")
        return real(*args, **kw)
    monkeypatch.setattr(mx, "load", load)
    yield opened
    _OPENED = None


@pytest.fixture
def target(tmp_path):
    """A copy of the demo target."""
    out = tmp_path / "target"
    shutil.copytree(api.DEMO / "target", out)
    return out


def test_the_counting_sees_a_load_read_the_weights(target, reads):
    md.load(str(target), str(api.DEMO / "drafter"), warm=False)
    assert any(r.startswith("mx.load") for r in reads) and any("model.safetensors" in r
                                                               for r in reads)


def test_a_missing_tokenizer_is_named_before_any_weight_is_read(target, reads):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        md.load(str(target), str(api.DEMO / "drafter"), warm=False)
    assert reads == []


@pytest.fixture
def foreign_drafter(tmp_path):
    """The demo drafter, its config saying it drafts for another vocabulary."""
    drafter = tmp_path / "drafter"
    shutil.copytree(api.DEMO / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["vocab_size"] = 8192
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


def test_a_drafter_for_another_target_is_named_before_any_weight_is_read(target,
                                                                         foreign_drafter,
                                                                         reads):
    drafter = foreign_drafter
    with pytest.raises(DrafterError, match="drafter vocab_size 8192 != target vocab_size 4096"):
        md.load(str(target), str(drafter), warm=False)
    assert reads == []


def test_the_cli_says_the_missing_tokenizer_in_one_line(target, reads, capsys):
    (target / "tokenizer.json").unlink()
    (target / "tokenizer_config.json").unlink()
    assert cli.main(["generate", "--model", str(target), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no tokenizer files" in err, err
    assert reads == []
