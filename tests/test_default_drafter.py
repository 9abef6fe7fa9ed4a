"""A drafter by default (issue 31): ``--model`` naming Lightning, recognised by its config and
never its name, speculates with NVIDIA's DSpark drafter without ``--drafter``: the converted
one in the local cache, else by its repo id; ``--drafter none`` opts out; the banner says which
drafter, or "serial only" and why. The real pair is 19 GB, so the load tests teach the table
of known targets the demo target's shape (checkpoint/pairing.KNOWN) and put the demo drafter
in the cache under a repo id."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint import pairing
from mlx_dspark.checkpoint.hub import cache_entry
from mlx_dspark.cli.commands import banner
from mlx_dspark.converter import hub
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.converter.layout import RECEIPT_NAME
from testkit.synthetic import lightning_config

REPO = "test-org/demo-dspark"


def test_lightning_is_known_by_its_config_in_every_layout_never_by_its_name():
    cfg = lightning_config()
    known = pairing.known_target(cfg)
    assert known.drafter == "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DSpark"
    mlx_lm = {**cfg, "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},
              "_name_or_path": "mlx-community/whatever-4bit"}
    assert pairing.known_target(mlx_lm) is known
    spelled = {k: v for k, v in cfg.items() if k != "hybrid_override_pattern"}
    kinds = {"M": "mamba", "E": "moe", "*": "attention"}
    spelled["layers_block_type"] = [kinds[c] for c in cfg["hybrid_override_pattern"]]
    assert pairing.known_target(spelled) is known
    assert pairing.known_target({**cfg, "hidden_size": 4096}) is None
    assert pairing.known_target(json.loads((DEMO / "target" / "config.json").read_text())) is None


@pytest.fixture
def known_demo(tmp_path, monkeypatch):
    """The demo target's shape as a known target whose drafter is REPO."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = json.loads((DEMO / "target" / "config.json").read_text())
    shape = {k: cfg[k] for k in ("hidden_size", "vocab_size", "n_routed_experts")}
    monkeypatch.setattr(pairing, "KNOWN", [pairing.Known(
        "the demo target", REPO, {**shape, "hybrid_override_pattern": "MEM*EM"})])


@pytest.fixture
def cached_drafter(known_demo):
    """REPO converted in the local cache (the demo drafter, its receipt naming REPO)."""
    entry = cache_entry(REPO)
    shutil.copytree(DEMO / "drafter", entry)
    receipt = json.loads((entry / RECEIPT_NAME).read_text())
    receipt["source"]["repo_id"] = REPO
    (entry / RECEIPT_NAME).write_text(json.dumps(receipt))
    return entry


def test_a_known_model_gets_its_drafter_from_the_local_cache(cached_drafter):
    pair = md.load(str(DEMO / "target"), "auto", dtype="float32", warm=False)
    assert pair.drafter is not None and pair.drafter.label == "DSpark"
    assert pair.drafter_note == (f"with the DSpark drafter {cached_drafter} (the default for "
                                 f"the demo target, from the local cache)")
    ids = [1, 281, 1092, 44]
    spec = md.generate(pair, ids, max_tokens=16, speculative="on")
    assert spec.stats.accepted > 0
    assert spec.tokens == md.generate(pair, ids, max_tokens=16, speculative="off").tokens


def test_the_cli_picks_it_without_drafter_and_none_opts_out(cached_drafter, capsys):
    base = ["generate", "--model", str(DEMO / "target"), "--dtype", "float32", "-p",
            "def f(x):", "-m", "8", "--speculative", "on"]
    assert cli.main(base) == 0
    capsys.readouterr()
    assert cli.main(base + ["--drafter", "none"]) == 1
    assert "--speculative 'on' needs a drafter" in capsys.readouterr().err
    assert md.load(str(DEMO / "target"), "none", warm=False).drafter_note == \
        "serial only (--drafter none)"
    assert md.load(None, "none", warm=False).drafter is None        # the demo pair, serial


def test_offline_without_the_cached_drafter_is_serial_and_says_why(known_demo, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = md.load(str(DEMO / "target"), "auto", warm=False)
    assert pair.drafter is None
    assert pair.drafter_note == (f"serial only (the demo target's DSpark drafter {REPO} is not "
                                 f"in the local cache and the hub is offline (HF_HUB_OFFLINE))")


def test_a_default_drafter_that_cannot_be_fetched_leaves_the_target_serial(known_demo,
                                                                           monkeypatch):
    def unreachable(repo_id, name, revision, required=False, offline=False):
        raise ConversionError(f"{repo_id}@main: download failed (no network)")

    monkeypatch.setattr(hub, "_reachable", lambda repo_id, revision: True)
    monkeypatch.setattr(hub, "_small_file", unreachable)
    monkeypatch.setattr(hub, "cached_snapshot", lambda repo_id, revision: None)
    pair = md.load(str(DEMO / "target"), "auto", warm=False)
    assert pair.drafter is None and pair.drafter_note.startswith(
        f"serial only (its default drafter {REPO} could not be fetched: {REPO}@main: download "
        f"failed (no network))")


def test_an_unknown_model_is_serial_and_the_banner_says_why(tmp_path):
    pair = md.load(str(DEMO / "target"), "auto", dtype="float32", warm=False)
    assert pair.drafter is None
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        line = banner(pair, "demo", sock, {})
    finally:
        sock.close()
    assert line.startswith(f"mlx-dspark serve: demo ({DEMO / 'target'}) serial only (no "
                           f"--drafter given, and none is known for this model's config), ")
    demo = md.load(dtype="float32", warm=False)
    assert demo.drafter_note == "with its DSpark drafter"
