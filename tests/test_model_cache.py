"""``load()`` and ``--model`` take a Hugging Face repo id of a ModelOpt export: converted on first
use into the cache, reused after (mlx_dspark/checkpoint/hub.py). No network: the hub is a local
stand-in, either huggingface_hub itself reading a prepared offline cache (the end-to-end test) or
the converter's fetch function pointed at a directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_dspark as md
from mlx_dspark.checkpoint import hub as model_cache
from testkit.cli_pair import FIXTURES, write_tokenizer
from mlx_dspark.converter import hub
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.converter.layout import RECEIPT_NAME

SCRIPT = str(Path(sys.executable).parent / "mlx-dspark")
TARGET, DRAFTER = "test-org/tiny-nemotron", "test-org/tiny-dspark"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """ModelOpt exports as a hub would serve them: the fixture target (with a tokenizer) and
    drafter."""
    root = tmp_path_factory.mktemp("exports")
    shutil.copytree(FIXTURES / "target_w4a16", root / "target")
    write_tokenizer(root / "target")
    shutil.copytree(FIXTURES / "drafter_nvfp4", root / "drafter")
    return {TARGET: root / "target", DRAFTER: root / "drafter"}


@pytest.fixture
def hub_stand_in(exports, tmp_path, monkeypatch):
    """The converter's fetch answers from ``exports``; returns the repo ids it was asked for."""
    asked = []

    def fetch(repo_id, revision):
        asked.append(repo_id)
        return str(exports[repo_id])

    monkeypatch.setattr(hub, "_snapshot_download", fetch)
    small_files_from(exports, monkeypatch)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    return asked


def small_files_from(exports, monkeypatch):
    """The hub's small files (config.json, the index: read before any download) come from
    ``exports`` too, and huggingface_hub's own cache holds none of these repos."""
    def small_file(repo_id, name, revision, required=False, offline=False):
        f = exports[repo_id] / name
        return f if f.is_file() else None

    monkeypatch.setattr(hub, "_reachable", lambda repo_id, revision: True)
    monkeypatch.setattr(hub, "_small_file", small_file)
    monkeypatch.setattr(hub, "cached_snapshot", lambda repo_id, revision: None)


def test_a_repo_id_is_converted_once_into_the_cache_then_reused(hub_stand_in, tmp_path, capsys):
    pair = md.load(TARGET, DRAFTER)
    assert hub_stand_in == [TARGET, DRAFTER]
    assert "first use of test-org/tiny-nemotron" in capsys.readouterr().err
    entry = tmp_path / "cache" / "test-org--tiny-nemotron--main"
    receipt = json.loads((entry / RECEIPT_NAME).read_text())
    assert receipt["source"]["repo_id"] == TARGET and receipt["model_kind"] == "target"
    first = md.generate(pair, "The quick brown fox", max_tokens=8)

    stamp = (entry / "model.safetensors").stat().st_mtime_ns
    again = md.load(TARGET, DRAFTER)
    assert hub_stand_in == [TARGET, DRAFTER]                  # the hub was not asked again
    assert "first use" not in capsys.readouterr().err
    assert (entry / "model.safetensors").stat().st_mtime_ns == stamp
    assert md.generate(again, "The quick brown fox", max_tokens=8).tokens == first.tokens


def test_a_cache_entry_from_another_repo_is_refused(hub_stand_in, tmp_path):
    model_cache.resolve(DRAFTER)
    wrong = tmp_path / "cache" / "test-org--tiny-nemotron--main"
    (tmp_path / "cache" / "test-org--tiny-dspark--main").rename(wrong)
    with pytest.raises(ConversionError, match=f"converted from {DRAFTER}@None, not {TARGET}@main"):
        md.load(TARGET)
    (wrong / RECEIPT_NAME).unlink()
    with pytest.raises(ConversionError, match=f"has no readable {RECEIPT_NAME}"):
        md.load(TARGET)


def test_a_local_directory_wins_over_a_repo_id_of_the_same_spelling(hub_stand_in, exports,
                                                                    tmp_path, monkeypatch):
    from mlx_dspark.converter import convert
    convert(str(exports[TARGET]), tmp_path / "test-org" / "tiny-nemotron", progress=False)
    monkeypatch.chdir(tmp_path)
    pair = md.load(TARGET)
    assert hub_stand_in == [] and not (tmp_path / "cache").exists()
    assert pair.drafter is None and pair.tokenizer is not None


def test_a_name_that_is_neither_a_directory_nor_a_repo_id_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        md.load(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no such drafter directory"):
        md.load(None, "./not/there")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        md.load(Path("not/there"))                  # a Path is never taken for a repo id


def hf_offline_cache(root: Path, repo: str, files: Path) -> None:
    """``files`` laid out as huggingface_hub's cache holds a download of ``repo`` at main."""
    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files, entry / "snapshots" / COMMIT)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)


@pytest.mark.slow
def test_model_repo_id_end_to_end_through_huggingface_hub_offline(exports, tmp_path):
    hf_offline_cache(tmp_path / "hub", TARGET, exports[TARGET])
    hf_offline_cache(tmp_path / "hub", DRAFTER, exports[DRAFTER])
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               MLX_DSPARK_CACHE=str(tmp_path / "cache"))
    argv = [SCRIPT, "generate", "--model", TARGET, "--drafter", DRAFTER, "-p", "Hi", "-m", "6",
            "--speculative", "on"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("first use of") == 2
    receipt = json.loads((tmp_path / "cache" / "test-org--tiny-nemotron--main" / RECEIPT_NAME)
                         .read_text())
    assert receipt["source"]["repo_id"] == TARGET and receipt["source"]["revision"] == COMMIT
    shutil.rmtree(tmp_path / "hub")                 # later runs need nothing from the hub
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "first use" not in second.stderr and second.stdout == first.stdout


def test_a_repo_id_the_hub_cannot_give_is_one_line_and_leaves_no_cache_entry(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               MLX_DSPARK_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([SCRIPT, "generate", "--model", "nobody/nothing", "-p", "Hi"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    first, *rest = p.stderr.splitlines()
    assert first.startswith("mlx-dspark: first use of nobody/nothing")
    assert rest == [rest[0]] and rest[0].startswith(
        "mlx-dspark generate: error: nobody/nothing@main: download failed (")
    assert not any((tmp_path / "cache").glob("*/*"))


def test_two_loads_of_one_repo_id_wait_for_one_conversion_and_both_use_it(exports, tmp_path,
                                                                          monkeypatch):
    import threading
    import time

    asked = []

    def slow_fetch(repo_id, revision):       # a download long enough for the race
        asked.append(repo_id)
        time.sleep(0.5)
        return str(exports[repo_id])

    monkeypatch.setattr(hub, "_snapshot_download", slow_fetch)
    small_files_from(exports, monkeypatch)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    got, errors = [], []

    def resolve():
        try:
            got.append(model_cache.resolve(DRAFTER))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=resolve) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and asked == [DRAFTER]
    assert got[0] == got[1] and (got[0] / RECEIPT_NAME).is_file()


@pytest.mark.parametrize("source", ['"just a string"', "[1, 2]", "null", "7"])
def test_a_cache_receipt_with_a_malformed_source_is_one_error(hub_stand_in, tmp_path, source):
    entry = model_cache.resolve(DRAFTER)
    receipt = json.loads((entry / RECEIPT_NAME).read_text())
    text = json.dumps({**receipt, "source": None}).replace('"source": null',
                                                           f'"source": {source}')
    (entry / RECEIPT_NAME).write_text(text)
    with pytest.raises(ConversionError, match=f"no readable {RECEIPT_NAME}") as e:
        model_cache.resolve(DRAFTER)
    assert "\n" not in str(e.value)


def test_an_extra_weight_file_in_a_cache_entry_is_not_read(hub_stand_in, tmp_path):
    import mlx.core as mx

    pair = md.load(TARGET)
    want = md.generate(pair, "The quick brown fox", max_tokens=8).tokens
    entry = tmp_path / "cache" / "test-org--tiny-nemotron--main"
    tensors = mx.load(str(entry / "model.safetensors"))
    mx.save_safetensors(str(entry / "model-00002.safetensors"),
                        {k: mx.zeros_like(v) for k, v in tensors.items()})
    again = md.load(TARGET)
    assert md.generate(again, "The quick brown fox", max_tokens=8).tokens == want
