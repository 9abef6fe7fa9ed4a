"""What a user can get wrong on the command line ends in one line and a non-zero exit, never a
traceback (issue 11, item 4): usage errors, bytes that are not UTF-8 (stdin, argv, chat), a
seed out of range, a reader that leaves early, Ctrl-C. On the embedded demo pair, driven as the
user drives it (a closed pipe and Ctrl-C in a subprocess and a pseudo-terminal)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from mlx_dspark import cli

# subprocesses and a pseudo-terminal: the slow lane
pytestmark = pytest.mark.slow

SCRIPT = str(Path(sys.executable).parent / "mlx-dspark")


def stdin(data: bytes) -> io.TextIOWrapper:
    """A piped standard input holding ``data``."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def test_usage_errors_are_one_line_with_exit_code_2(capsys):
    for argv in (["generate", "--max-tokens", "lots"], ["bogus"], ["verify"],
                 ["serve", "--port", "99999"]):
        try:
            cli.main(argv)
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ": error: " in err and err.endswith("--help)\n"), err


def test_non_utf8_prompt_on_stdin_or_argv_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", stdin(b"caf\xe9 au lait"))
    assert cli.main(["generate"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == ("mlx-dspark generate: error: the prompt on standard input is "
                                 "not UTF-8 text (byte 0xe9 at character 3)\n")
    # bytes in argv reach Python as lone surrogates (os.fsdecode), as here
    assert cli.main(["generate", "-p", os.fsdecode(b"\xff\xfe")]) == 1
    assert capsys.readouterr().err == ("mlx-dspark generate: error: --prompt is not UTF-8 text "
                                       "(byte 0xff at character 0)\n")


def test_chat_says_a_non_utf8_message_was_not_sent_and_goes_on(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", stdin(b"ab\xffcd\nhello\n/quit\n"))
    assert cli.main(["chat", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "error: that message is not UTF-8 text (byte 0xff at character 2); it was not " \
           "sent\n" in out
    assert re.search(r"\[3 tokens, .*prompt \d+ tokens: \d+ prefilled, 0 reused", out)


def test_seed_minus_one_is_random_and_out_of_range_seeds_are_one_line(capsys):
    for seed in ("-2", str(2 ** 64)):
        try:
            cli.main(["generate", "-p", "def f", "--seed", seed])
        except SystemExit as e:
            assert e.code == 2
        assert capsys.readouterr().err == (
            f"mlx-dspark generate: error: argument --seed: {seed}: a seed is 0 to 2**64-1 (or -1 "
            f"for a random one) (see mlx-dspark generate --help)\n")
    for seed in ("-1", str(2 ** 64 - 1)):
        assert cli.main(["generate", "-p", "def f", "--max-tokens", "3", "--temp", "1",
                         "--seed", seed]) == 0
        assert capsys.readouterr().err == ""


def test_closed_standard_output_ends_quietly():
    """`mlx-dspark generate ... | head -c 10`."""
    proc = subprocess.Popen([SCRIPT, "generate", "-p", "def f(x):", "--max-tokens", "400",
                             "--speculative", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


def test_ctrl_c_in_generate_ends_the_line_then_notes_it_and_prints_the_stats():
    child = pexpect.spawn(SCRIPT, ["generate", "-p", "def f(x):", "--max-tokens", "4000",
                                   "--speculative", "off", "--stats"],
                          timeout=60, dimensions=(24, 250))
    child.expect(rb"\S{8}")                          # the answer is streaming
    child.sendintr()
    child.expect(pexpect.EOF)
    child.wait()        # its exit, however long after EOF (close() kills a slow one)
    child.close()
    out = child.before.decode()
    assert child.exitstatus == 130
    assert "\r\nmlx-dspark generate: interrupted\r\n==========\r\n" in out, out
    stats = dict(line.split(": ", 1) for line in out.split("==========\r\n")[1].splitlines())
    assert stats["finish"] == "interrupted"
    assert 1 <= int(stats["generation"].split()[0]) < 4000


def test_a_prompt_longer_than_the_context_is_one_line_and_no_tokenizer_warning():
    r = subprocess.run([SCRIPT, "generate", "-m", "2", "--ignore-chat-template"],
                       input="x = 1\n" * 70000, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "the model's context limit is 65536" in r.stderr, r.stderr
