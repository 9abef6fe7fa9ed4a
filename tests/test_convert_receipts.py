"""Determinism, receipts (docs/design.md §4), source pins, and resolving SRC as a Hugging Face repo
id (through huggingface_hub's real offline cache path: tests never touch the network)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path


from testkit.synthetic import synth_drafter, synth_target
from mlx_dspark import __version__
from mlx_dspark.cli import main
from mlx_dspark.converter import convert
from mlx_dspark.converter.hub import resolve_source
from mlx_dspark.converter.receipts import load_pins

ROOT = Path(__file__).resolve().parents[1]
DRAFTER_REPO = "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DSpark"
REV = "0123456789abcdef0123456789abcdef01234567"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_hashes(d: Path) -> dict:
    return {p.name: sha(p) for p in sorted(d.iterdir())}


def write_pins(path: Path, repo: str, revision: str, files) -> Path:
    path.write_text(json.dumps({"format": "mlx-dspark-pins/1", "sources": {
        repo: {"kind": "target", "revision": revision, "files": files}}}))
    return path


def real_pins(src: Path) -> dict:
    return {p.name: {"size": p.stat().st_size, "sha256": sha(p)} for p in sorted(src.iterdir())
            if p.is_file()}


def test_two_conversions_are_byte_identical(tmp_path):
    synth_target(tmp_path / "a" / "src", "MIXED_PRECISION", shards=2)
    synth_target(tmp_path / "b" / "elsewhere", "MIXED_PRECISION", shards=2)
    o1 = convert(str(tmp_path / "a" / "src"), tmp_path / "a" / "out", progress=False)
    o2 = convert(str(tmp_path / "b" / "elsewhere"), tmp_path / "b" / "x" / "out2",
                 progress=False, shard_bytes=1 << 30)
    h1, h2 = tree_hashes(o1), tree_hashes(o2)
    assert "MERERUN_CONVERSION.json" in h1 and "model.safetensors" in h1
    assert h1 == h2


def test_receipt_records_real_hashes_of_every_source_and_output_file(tmp_path):
    src = tmp_path / "src"
    synth_drafter(src)
    (src / ".cache" / "huggingface").mkdir(parents=True)      # `hf download --local-dir` state
    (src / ".cache" / "huggingface" / "x.lock").write_text("")
    out = convert(str(src), tmp_path / "out", progress=False)
    r = json.loads((out / "MERERUN_CONVERSION.json").read_text())
    assert r["converter"]["version"] == __version__
    assert r["converter"]["layout"] == "mlx-dspark/1"
    assert r["source"]["repo_id"] is None and r["source"]["revision"] is None
    assert r["source"]["files"] == real_pins(src)
    outputs = {p.name for p in out.iterdir()} - {"MERERUN_CONVERSION.json"}
    assert set(r["outputs"]) == outputs
    for name, entry in r["outputs"].items():
        data = (out / name).read_bytes()
        want = {"size": len(data), "sha256": sha(out / name)}
        if name.endswith(".safetensors"):     # and each 16 MiB block's, for sampled checks
            want["blocks"] = {"size": 16 << 20, "sha256": [
                hashlib.sha256(data[i:i + (16 << 20)]).hexdigest()
                for i in range(0, len(data), 16 << 20)]}
        assert entry == want
    assert r["pins"]["status"] == "unpinned"
    assert "timestamp" not in json.dumps(r) and str(tmp_path) not in json.dumps(r)


def test_packaged_pins_are_the_top_level_pin_file():
    assert (ROOT / "converter" / "pins.json").read_bytes() == \
        (ROOT / "MERERUN_CONVERSION.json").read_bytes()
    pins = load_pins()
    assert pins[DRAFTER_REPO]["revision"] == "e3af76fbff445ef795958bee96bc1126af70fd57"
    target = pins["nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4"]
    assert target["revision"] == "unknown" and target["files"] == "unknown"


def test_source_matching_its_pins_is_verified(tmp_path, capsys):
    src = tmp_path / "src"
    synth_target(src, "W4A16_NVFP4")
    pins = write_pins(tmp_path / "pins.json", "test-org/tiny", REV, real_pins(src))
    rc = main(["convert", str(src), "-o", str(tmp_path / "out"), "--pins", str(pins),
               "--repo-id", "test-org/tiny"])
    assert rc == 0
    assert "verified against pins" in capsys.readouterr().err
    r = json.loads((tmp_path / "out" / "MERERUN_CONVERSION.json").read_text())
    assert r["pins"]["status"] == "pinned"
    assert r["pins"]["verified_files"] == sorted(real_pins(src))
    assert r["source"]["repo_id"] == "test-org/tiny"


def test_source_hash_contradicting_a_pin_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    synth_target(src, "W4A16_NVFP4")
    files = real_pins(src)
    files["model.safetensors"]["sha256"] = "0" * 64
    pins = write_pins(tmp_path / "pins.json", "test-org/tiny", "unknown", files)
    out = tmp_path / "out"
    rc = main(["convert", str(src), "-o", str(out), "--pins", str(pins),
               "--repo-id", "test-org/tiny"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "model.safetensors" in err and "contradicts the pin" in err
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_partially_pinned_source_says_which_files_are_unpinned(tmp_path, capsys):
    src = tmp_path / "src"
    synth_target(src, "W4A16_NVFP4")
    files = {"config.json": real_pins(src)["config.json"]}
    pins = write_pins(tmp_path / "pins.json", "test-org/tiny", "unknown", files)
    assert main(["convert", str(src), "-o", str(tmp_path / "out"), "--pins", str(pins),
                 "--repo-id", "test-org/tiny"]) == 0
    assert "partially pinned" in capsys.readouterr().err
    r = json.loads((tmp_path / "out" / "MERERUN_CONVERSION.json").read_text())
    assert r["pins"]["verified_files"] == ["config.json"]
    assert "model.safetensors" in r["pins"]["unpinned_files"]


def make_hf_cache(cache: Path, repo: str, rev: str, build) -> Path:
    """The layout huggingface_hub itself reads: models--org--name/{refs,snapshots/<rev>}."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / rev
    build(snap)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(rev)
    return snap


def test_local_hf_cache_snapshot_is_identified_by_repo_and_revision(tmp_path):
    snap = make_hf_cache(tmp_path, "test-org/tiny", REV, lambda p: p.mkdir(parents=True))
    s = resolve_source(str(snap), None, {})
    assert (s.repo_id, s.revision, s.path) == ("test-org/tiny", REV, snap.resolve())


def test_local_snapshot_at_a_revision_contradicting_the_pin_is_refused(tmp_path, capsys):
    snap = make_hf_cache(tmp_path / "cache", "test-org/tiny", REV,
                         lambda p: synth_target(p, "W4A16_NVFP4"))
    pins = write_pins(tmp_path / "pins.json", "test-org/tiny", "f" * 40, "unknown")
    rc = main(["convert", str(snap), "-o", str(tmp_path / "out"), "--pins", str(pins)])
    err = capsys.readouterr().err
    assert rc == 1 and f"revision {REV} of test-org/tiny contradicts the pinned revision" in err
    assert not (tmp_path / "out").exists()


def _cli(args, cache: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "HF_HOME": str(cache.parent / "hf-home")}
    return subprocess.run([sys.executable, "-m", "mlx_dspark.cli", *args],
                          capture_output=True, text=True, env=env)


def test_repo_id_source_is_fetched_at_the_pinned_revision_through_huggingface_hub(tmp_path):
    cache = tmp_path / "cache"
    snap = make_hf_cache(cache, "test-org/tiny", REV, lambda p: synth_drafter(p))
    # a second snapshot that "main" points to: the pin, not main, must win
    (snap.parent / ("e" * 40)).mkdir()
    (snap.parent / ("e" * 40) / "config.json").write_text("{}")
    (snap.parent.parent / "refs" / "main").write_text("e" * 40)
    pins = write_pins(tmp_path / "pins.json", "test-org/tiny", REV, "unknown")
    r = _cli(["convert", "test-org/tiny", "-o", str(tmp_path / "out"), "--pins", str(pins)], cache)
    assert r.returncode == 0, r.stderr
    receipt = json.loads((tmp_path / "out" / "MERERUN_CONVERSION.json").read_text())
    assert receipt["source"]["repo_id"] == "test-org/tiny"
    assert receipt["source"]["revision"] == REV
    assert receipt["pins"]["revision_verified"] is True
    assert receipt["source"]["files"] == real_pins(snap)


def test_unavailable_repo_id_fails_with_one_line(tmp_path):
    r = _cli(["convert", "test-org/absent", "-o", str(tmp_path / "out")], tmp_path / "cache")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "test-org/absent" in r.stderr and "download failed" in r.stderr
    assert not (tmp_path / "out").exists()
