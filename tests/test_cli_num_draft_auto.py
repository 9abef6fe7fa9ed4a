"""``--num-draft auto`` from the command line: generate gives the serial text and drafts rounds
of several lengths; a word that is neither a length nor auto is a one-line error; serve takes
it; ``bench --drafters all --num-draft 1 auto`` compares every registered drafter kind, at a
fixed length and at auto, in one run (the embedded demo pair)."""

from __future__ import annotations

import json

import pytest

from mlx_dspark import cli
from mlx_dspark.cli.commands import serve_arguments
from mlx_dspark.drafters import KINDS
from test_cli import one_line_error, pair, pair_dirs, parse_stats, run  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def test_generate_num_draft_auto_gives_the_serial_text(pair):  # noqa: F811
    base = ["generate", *pair, "--prompt", "def fibonacci(n):", "--max-tokens", "24"]
    auto = run(*base, "--speculative", "on", "--num-draft", "auto", "--stats")
    serial = run(*base, "--speculative", "off")
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout == serial.stdout
    s = parse_stats(auto.stderr)
    assert int(s["rounds"][0]) > 0
    # acceptance is reported for every position auto may choose (the longest: 7)
    assert len(s["acceptance by position"][0].split()) == 7


def test_num_draft_neither_a_length_nor_auto_is_a_one_line_error(capsys, pair):  # noqa: F811
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *pair, "--num-draft", "most", "-p", "x"])
    assert e.value.code == 2
    assert "argument --num-draft: invalid draft length value: 'most'" in \
        capsys.readouterr().err


def test_serve_takes_num_draft_auto():
    import argparse
    p = argparse.ArgumentParser()
    serve_arguments(p)
    assert p.parse_args(["--num-draft", "auto"]).num_draft == "auto"
    assert p.parse_args(["--num-draft", "4"]).num_draft == 4


def test_bench_compares_every_registered_drafter_at_fixed_and_auto_num_draft():
    p = run("bench", "--drafters", "all", "--num-draft", "1", "auto", "--limit", "1",
            "--domains", "code", "--max-tokens", "8", "--repeats", "1", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    # the registry's every kind: run, or skipped with the reason (none on the demo pair)
    assert list(r["drafters"]) == list(KINDS) and r["skipped"] == {}
    assert r["settings"]["num_draft"] == [1, "auto"]
    rows = {(x["domain"], x["drafter"], x["num_draft"]) for x in r["results"]}
    assert rows == {(d, k, n) for d in ("code", "all") for k in KINDS for n in (1, "auto")}
    for x in r["results"]:
        assert x["same_tokens"] == x["prompts"]
        assert x["draft_cost"] > 0 and x["verify_cost"] > 0 and x["predicted_speedup"] > 0
        assert 1 <= x["drafts_per_round"] <= 7
