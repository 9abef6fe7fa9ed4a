"""Every transcript quoted in README.md and docs/*.md is what today's code prints
(docs/transcripts.py), and the checker does fail on a stale one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# reruns every quoted command: the slow lane
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("transcripts", ROOT / "docs" / "transcripts.py")
transcripts = sys.modules["transcripts"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(transcripts)

ALL = [b for doc in transcripts.documents() for b in transcripts.blocks(doc)]


@pytest.mark.parametrize("block", ALL, ids=[f"{b.doc.name}:{b.name}" for b in ALL])
def test_quoted_transcript_matches_what_the_command_prints_today(block):
    diff = transcripts.differences(block.lines, transcripts.produce(block), block.flags)
    assert not diff, f"{block.where} is stale (python docs/transcripts.py rewrites it):\n" + \
        "\n".join(diff)


STATS = """$ mlx-dspark generate -p x --stats
hello
==========
mode: speculative (requested on, 0 switches)
prompt: 7 tokens, 7 prefilled, 213.2 tokens/s
generation: 32 tokens, 171.6 tokens/s
rounds: 11 speculative, 1 serial
mean accepted per round: 1.73
acceptance by position: 0.82 0.67 0.67
finish: length
peak memory: 0.019 GB (MLX), process peak RSS 0.120 GB""".splitlines()


def edited(lines, old, new):
    return [line.replace(old, new) for line in lines]


def test_differences_ignore_timing_and_memory_but_nothing_else():
    d = transcripts.differences
    timing = edited(edited(edited(STATS, "213.2", "9.0"), "171.6", "80.25"), "0.120 GB", "1.5 GB")
    assert d(STATS, timing, set()) == []
    for old, new in [("rounds: 11", "rounds: 12"), ("1.73", "1.74"), ("0.82 0.67", "0.82 0.68"),
                     ("finish: length", "finish: stop"), ("32 tokens", "31 tokens"),
                     ("hello", "hullo"), ("requested on", "requested auto")]:
        assert d(STATS, edited(STATS, old, new), set()), (old, new)
    assert d(STATS, STATS[:-1], set())                     # a line gone
    # "varies": numbers and the mode word may change, the text and the layout may not
    auto = edited(edited(STATS, "rounds: 11", "rounds: 3"), "mode: speculative", "mode: serial")
    assert d(STATS, auto, {"varies"}) == [] and d(STATS, auto, set())
    assert d(STATS, edited(STATS, "hello", "hullo"), {"varies"})


# A command whose speed differs on every run (bash's $RANDOM) and whose counts do not.
COMMAND = "printf 'hello\\nrounds: 3 speculative, 0 serial\\ngeneration: 6 tokens, %s tokens/s\\n' $RANDOM"


def test_writing_fills_a_block_and_checking_fails_once_a_stats_line_changes(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    before, after = "# Title\n\nSome prose.\n\n<!-- transcript: demo -->\n```console\n", \
        "```\n\nMore prose.\n"
    doc.write_text(before + f"$ {COMMAND}\n(to be filled)\n" + after)
    assert transcripts.write(doc) == 1
    text = doc.read_text()
    assert text.startswith(before + f"$ {COMMAND}\nhello\nrounds: 3 speculative, 0 serial\n"
                                     f"generation: 6 tokens, ")
    assert text.endswith(" tokens/s\n" + after)
    assert transcripts.check(doc) == []                       # another speed, same counts

    doc.write_text(text.replace("\nrounds: 3 speculative", "\nrounds: 99 speculative"))
    assert transcripts.main(["--check", str(doc)]) == 1
    report = capsys.readouterr().out
    assert "doc.md:7 (transcript demo) is stale" in report
    assert "quoted:   rounds: 99 speculative" in report


def test_a_marker_without_a_block_or_command_is_named(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text("<!-- transcript: lonely -->\nprose\n")
    with pytest.raises(ValueError, match="bad.md:1: transcript lonely must be followed by a "
                                         "fenced block"):
        transcripts.blocks(doc)
    doc.write_text("<!-- transcript: empty -->\n```\nno command\n```\n")
    with pytest.raises(ValueError, match="no '\\$ ' command line"):
        transcripts.blocks(doc)
    doc.write_text("<!-- transcript: x loose -->\n```\n$ true\n```\n")
    with pytest.raises(ValueError, match="unknown transcript flag"):
        transcripts.blocks(doc)
