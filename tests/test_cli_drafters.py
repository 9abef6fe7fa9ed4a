"""Every drafter from the command line: ``--drafter mtp`` and an EAGLE-3 head's directory on
generate, and ``bench --drafter A --drafter B --drafter C --num-draft N M`` comparing them in
one run (tests/cli_pair.py: the fixture target with a random MTP block, the fixture DSpark
drafter, a synthetic EAGLE-3 head, all through the real converter)."""

from __future__ import annotations

import json

import pytest

from testkit.cli_pair import make_pair
from test_cli import DTYPE, one_line_error, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("drafters"), drafters=True)


@pytest.mark.parametrize("which", ["mtp", "eagle3"])
def test_generate_with_each_drafter_gives_the_serial_text(dirs, which):
    target, _, eagle3 = dirs
    drafter = "mtp" if which == "mtp" else str(eagle3)
    base = ["generate", "--model", str(target), *DTYPE, "-p", "def f(x):", "-m", "16"]
    spec = run(*base, "--drafter", drafter, "--speculative", "on", "--num-draft", "3")
    serial = run(*base, "--speculative", "off")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == serial.stdout


def test_bench_compares_three_drafters_at_two_draft_lengths_in_one_run(dirs):
    target, dspark, eagle3 = dirs
    p = run("bench", "--model", str(target), *DTYPE, "--drafter", str(dspark), "--drafter",
            "mtp", "--drafter", str(eagle3), "--num-draft", "2", "4", "--limit", "1",
            "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert list(r["drafters"]) == ["drafter", "mtp", "eagle3"]
    assert all(v.endswith("tensors match") for v in r["drafters"].values())
    assert r["settings"]["num_draft"] == [2, 4]
    rows = {(x["domain"], x["drafter"], x["num_draft"]): x for x in r["results"]}
    assert set(rows) == {(d, k, n) for d in ("code", "math", "chat", "all")
                         for k in ("drafter", "mtp", "eagle3") for n in (2, 4)}
    for x in rows.values():
        assert x["same_tokens"] == x["prompts"]             # greedy fp32: lossless
        assert x["mean_tokens_per_round"] >= 1 and x["draft_cost"] > 0 and x["verify_cost"] > 0
        assert x["predicted_speedup"] > 0 and x["speedup"] > 0
        assert len(x["acceptance_by_position"]) == x["num_draft"]
    # serial is measured once: every drafter's row of a domain has the same serial rate
    for d in ("code", "all"):
        assert len({x["tokens_per_s"]["serial"] for k, x in rows.items() if k[0] == d}) == 1


def test_bench_table_names_each_drafter(dirs):
    target, dspark, _ = dirs
    p = run("bench", "--model", str(target), *DTYPE, "--drafter", str(dspark), "--drafter",
            "mtp", "--limit", "1", "--max-tokens", "6", "--domains", "code")
    assert p.returncode == 0, p.stderr
    lines = [line.split() for line in p.stdout.splitlines()]
    assert ["code", "drafter", "3"] in [line[:3] for line in lines]
    assert ["all", "mtp", "3"] in [line[:3] for line in lines]


def test_the_same_drafter_twice_is_a_one_line_error(capsys, dirs):
    target = dirs[0]
    err = one_line_error(capsys, ["bench", "--model", str(target), "--drafter", "mtp",
                                  "--drafter", "mtp"])
    assert "--drafter: mtp given twice" in err


def test_mtp_on_a_target_converted_without_it_is_a_one_line_error(capsys, tmp_path):
    from test_cli import make_pair as plain
    target, _ = plain(tmp_path)
    capsys.readouterr()                          # the conversion's own report
    err = one_line_error(capsys, ["generate", "--model", str(target), "--drafter", "mtp",
                                  "-p", "x"])
    assert "declares no MTP block" in err


def test_the_demo_drafters_by_name_without_model(capsys):
    for name in ("mtp", "eagle3", "dflash"):
        p = run("generate", "--drafter", name, "-p", "def f(x):", "-m", "8",
                "--ignore-chat-template", "--speculative", "on", "--stats")
        assert p.returncode == 0 and "rounds:" in p.stderr, p.stderr
    err = one_line_error(capsys, ["generate", "--drafter", "medusa", "-p", "x"])
    assert "medusa: no such drafter directory" in err
