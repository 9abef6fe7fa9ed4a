"""Long prompts in ``generate`` and ``chat``, seen and stoppable (issue 33 item 2): a prefill
that takes more than a second shows its progress on stderr (tokens, rate, time left), a short
one shows nothing; Ctrl-C stops a prefill before its next piece (about 512 tokens) and at any
moment of the start (imports, model load) ends the command with one line and exit code 130,
never a traceback. Real processes of the console script on the embedded demo pair, and the
progress meter itself on a pipe and on a terminal."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pexpect.popen_spawn
import pytest

from mlx_dspark.cli.common import CatchInterrupt, PrefillMeter
from mlx_dspark.decode.pieces import PIECE

SCRIPT = str(Path(sys.executable).parent / "mlx-dspark")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
GENERATE = [SCRIPT, "generate", "--ignore-chat-template", "-m", "3", "--speculative", "off"]
# about 3,000 tokens of the demo tokenizer: several seconds of prefill on 2 cores
LONG = " ".join(f"def f{i}(x): return x + {i}" for i in range(200))
# about 8,800 tokens: on a quiet machine (1,400 tokens/s) the rest of the prefill, after the
# first progress line at one second, still takes seconds, so stopping within a piece shows
LONGER = " ".join(f"def f{i}(x): return x + {i}" for i in range(600))
PROGRESS = re.compile(r"prefill (\d+)/(\d+) tokens, (\d+) tokens/s, about (\d+) s left")


@pytest.mark.slow          # subprocesses
def test_a_short_prompt_shows_no_prefill_progress():
    r = subprocess.run(GENERATE + ["-p", "def f(x):"], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def _until_progress(proc) -> re.Match:
    """Read the child's stderr up to its first progress line."""
    seen = ""
    while (line := proc.stderr.readline()) != "":
        seen += line
        if m := PROGRESS.search(line):
            return m
    raise AssertionError(f"no progress line; stderr: {seen}")


@pytest.mark.slow          # subprocesses
def test_ctrl_c_in_generate_during_the_prefill_stops_within_a_piece_and_exits_130():
    proc = subprocess.Popen(GENERATE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    proc.stdin.write(LONGER)
    proc.stdin.close()
    m = _until_progress(proc)          # shown once the prefill has taken a second
    done, total, rate = int(m[1]), int(m[2]), int(m[3])
    assert PIECE <= done < total and rate > 0
    proc.send_signal(signal.SIGINT)
    status = proc.wait(60)
    err, out = proc.stderr.read(), proc.stdout.read()
    assert status == 130, err
    assert err.endswith("mlx-dspark generate: interrupted\n") and "Traceback" not in err, err
    assert out == "\n"                               # no answer: the prefill never ended
    # (where it stops, in tokens: test_ctrl_c_during_a_piece_stops_the_prefill_at_its_end)


def _started(proc):
    """Read the child's stderr until mlx-dspark's ``main`` runs (``PYTHONPROFILEIMPORTTIME``
    prints each import as it completes): the first import after its package's, pip's console
    script importing nothing more before it calls ``main``."""
    seen, package = [], False
    while (line := proc.stderr.readline()) != "":
        seen.append(line)
        if package:
            return
        package = line.rstrip().endswith("| mlx_dspark.cli")
    raise AssertionError(f"mlx-dspark's main never ran: {''.join(seen)}")


@pytest.mark.slow          # subprocesses
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ctrl_c_at_any_moment_of_the_start_is_one_line_and_exit_130(command):
    """From the moment mlx-dspark's ``main`` runs (before it, the interpreter's own start and
    pip's console script are Python's; README) through its imports, the model load and the
    prefill."""
    argv = GENERATE if command == "generate" else [SCRIPT, "chat", "--speculative", "off"]
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0):
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"})
        proc.stdin.write(LONG + "\n")
        proc.stdin.close()      # the end of its input: chat, past a stopped message, exits
        _started(proc)
        rest = []               # read on, so that the child never waits on a full pipe
        reader = threading.Thread(target=lambda: rest.append(proc.stderr.read()))
        reader.start()
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()
        proc.wait(60)
        reader.join(60)
        err = "".join(line + "\n" for line in rest[0].splitlines()
                      if not line.startswith("import time:"))
        assert "Traceback" not in err, (delay, err)
        if command == "chat" and proc.returncode == 0:
            # past the start, chat's Ctrl-C stopped the message (or was at its prompt), and it
            # read the end of its input; or, on a quick machine, the whole message had been
            # answered (its stats line ends with the finish) and chat had left at the end of its
            # input before the signal came: no moment of the start was left to interrupt
            finished = re.search(r", (?:stop|length)\]\n>>> \n$", out)
            assert "it was not sent" in out or "Ctrl-D or /quit exits" in out or finished, \
                (delay, out)
        else:
            assert proc.returncode == 130, (delay, proc.returncode, err)
            assert re.search(r"(?:^|\n)mlx-dspark( \w+)?: interrupted\n$", err), (delay, err)


@pytest.mark.slow          # subprocesses
def test_ctrl_c_in_chat_during_a_long_message_drops_it_and_the_conversation_goes_on():
    chat = pexpect.popen_spawn.PopenSpawn([SCRIPT, "chat", "--speculative", "off", "-m", "4"],
                                          encoding="utf-8", timeout=60, env=ENV)
    chat.expect(">>> ")
    chat.sendline("def f(x):")
    chat.expect(r"prompt (\d+) tokens: (\d+) prefilled, (\d+) reused")
    first = int(chat.match[1])
    chat.expect(">>> ")
    chat.sendline(LONG)
    chat.expect(PROGRESS)                # stderr: merged with stdout here
    done, total, rate = (int(chat.match[i]) for i in (1, 2, 3))
    chat.kill(signal.SIGINT)
    chat.expect(r"\(stopped reading the message at (\d+) of (\d+) prompt tokens; it was not "
                r"sent\)")
    assert done <= int(chat.match[1]) < int(chat.match[2]) == total
    chat.expect(">>> ")
    # the session went back to the conversation before the message: the next turn reuses it
    chat.sendline("def g(y):")
    chat.expect(r"prompt (\d+) tokens: (\d+) prefilled, (\d+) reused")
    assert int(chat.match[3]) >= first
    chat.expect(">>> ")
    chat.sendline("/quit")
    chat.expect(pexpect.EOF)
    assert chat.wait() == 0
    assert "Traceback" not in chat.before


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stderr", [io.StringIO, Terminal])
def test_the_meter_shows_a_prefill_once_it_has_taken_a_second(monkeypatch, stderr):
    err = stderr()
    monkeypatch.setattr(sys, "stderr", err)
    meter = PrefillMeter(CatchInterrupt())
    for call in [(100, 3000, 0.0), (612, 3000, 0.5), (1124, 3000, 1.25), (3000, 3000, 3.2)]:
        meter(*call)
    # the rate counts the tokens prefilled, not the 100 reused: 1024 in 1.25 s
    line = "prefill 1124/3000 tokens, 819 tokens/s, about 2 s left"
    if stderr is Terminal:        # one line rewritten in place, cleared once done
        assert err.getvalue() == f"\r{line}\x1b[K\r\x1b[K"
    else:
        assert err.getvalue() == f"{line}\nprefill 3000/3000 tokens, 906 tokens/s, 3.2 s\n"


def test_the_meter_stops_an_unfinished_prefill_after_ctrl_c(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    interrupt = CatchInterrupt()
    meter = PrefillMeter(interrupt)
    meter(0, 2000, 0.0)
    interrupt.hit = True
    with pytest.raises(KeyboardInterrupt):
        meter(512, 2000, 0.4)
    meter(2000, 2000, 1.5)         # done: the first token comes, and stops the answer


DROPPED = """
import sys, time, weakref
from mlx_dspark.cli.interrupted import arm
arm()
class Slow:
    def __del__(self):
        print("in it", flush=True)
        time.sleep(1.0)
class Thing:
    pass
def callback(ref):
    print("in it", flush=True)
    time.sleep(1.0)
if sys.argv[1] == "finalizer":
    slow = Slow()
else:
    slow = Thing()
    ref = weakref.ref(slow, callback)
try:
    del slow
    time.sleep(5)
    print("went on", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.parametrize("where", ["finalizer", "weakref callback"])
def test_a_ctrl_c_that_python_would_drop_is_raised_once_it_can_be(where):
    # Python prints an exception raised in a finalizer or a weakref callback as "ignored" and
    # goes on: with its own handler alone such a Ctrl-C (as one landing in the regex package's
    # __del__ or importlib's module-lock callback while a tokenizer loads) printed a traceback
    # and was lost
    proc = subprocess.Popen([sys.executable, "-c", DROPPED, where.split()[0]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "in it\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert out == "interrupted\n" and "Exception ignored" not in err, (out, err)


# Runs the console script's main() with a trace that sends this process a SIGINT at the
# AT-th bytecode instruction of mlx-dspark's main functions (cli/__init__.py's and
# cli/dispatch.py's), counted from the start of interrupted.arm: from the first point at which
# a signal can be handled inside main (before it, main's own instructions hold none), through
# the imports, the rebinding of names, the command and its return. The handler runs as the
# instruction does, so every instruction is a moment a Ctrl-C lands on, none left to timing.
AT_INSTRUCTION = f"""
import os, signal, sys
at, seen = int(sys.argv[1]), None
def step(frame, event, arg):
    global seen
    if frame.f_code.co_name == "arm" and seen is None:
        seen = 0
    if event == "opcode" and seen is not None:
        seen += 1
        if seen == at:
            os.kill(os.getpid(), signal.SIGINT)
    return step
def enter(frame, event, arg):
    code = frame.f_code
    if {os.sep + 'mlx_dspark' + os.sep + 'cli' + os.sep!r} in code.co_filename \\
            and code.co_name in ("main", "arm"):
        frame.f_trace_opcodes = True
        return step
sys.settrace(enter)
sys.argv = ["mlx-dspark", "verify", sys.argv[2]]
from mlx_dspark.cli import main
code = main()
sys.settrace(None)
print(f"instructions: {{seen}}", file=sys.stderr)
sys.exit(code)
"""


def _at_instruction(at: int, directory) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AT_INSTRUCTION, str(at), str(directory)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow          # subprocesses
def test_a_ctrl_c_at_every_instruction_of_main_is_one_line_and_exit_130(tmp_path):
    # verify on a directory without a receipt: all of main's path, without MLX
    alone = _at_instruction(0, tmp_path)
    error = f"mlx-dspark verify: error: {tmp_path}: no conversion receipt"
    assert alone.returncode == 1 and alone.stderr.startswith(error), alone.stderr
    count = int(re.search(r"instructions: (\d+)", alone.stderr)[1])
    assert count > 50
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda at: _at_instruction(at, tmp_path), range(1, count + 1)))
    stopped = 0
    for at, r in enumerate(runs, 1):
        assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, (at, r.stderr)
        told = r.stderr.count(": interrupted")
        if r.returncode == 130:       # one line, naming the command once it is known
            assert told == 1 and re.search(r"\nmlx-dspark( verify)?: interrupted\ninstructions",
                                           r.stderr), (at, r.stderr)
            stopped += 1
        else:                         # past the command's end: nothing left to stop
            assert (r.returncode, told) == (1, 0) and r.stderr.startswith(error), (at, r.stderr)
    # all but the last few instructions, the way out after the command finished
    assert stopped >= count - 5, (stopped, count)


ONCE = """
import os, signal
from mlx_dspark.cli.interrupted import arm, carry_on
arm()
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)     # handled at the next instruction
try:
    ctrl_c()
    print("not raised")
except KeyboardInterrupt:
    ctrl_c()            # a second one while the first is being handled: nothing
    print("second one ignored", flush=True)
carry_on()              # as chat does, back at its prompt
try:
    ctrl_c()
    print("not raised")
except KeyboardInterrupt:
    print("raised again")
"""


def test_one_ctrl_c_raises_once_until_the_command_carries_on():
    r = subprocess.run([sys.executable, "-c", ONCE], capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "second one ignored\nraised again\n", "")


@pytest.mark.slow          # subprocesses
def test_ctrl_c_at_the_chat_prompt_twice_keeps_the_conversation():
    chat = pexpect.popen_spawn.PopenSpawn([SCRIPT, "chat", "--speculative", "off", "-m", "4"],
                                          encoding="utf-8", timeout=60, env=ENV)
    chat.expect(">>> ")
    for _ in range(2):      # the second Ctrl-C raises again: chat carried on from the first
        chat.kill(signal.SIGINT)
        chat.expect(r"\(Ctrl-D or /quit exits\)")
    chat.sendline("/quit")
    chat.expect(pexpect.EOF)
    assert chat.wait() == 0
    assert "Traceback" not in chat.before


# Runs a command with its prefill meter wrapped: right after the meter has seen the end of
# piece AT (counting its first call, the tokens already held, as 0), the process sends itself a
# SIGINT, which is handled there, before the next piece runs: a Ctrl-C during that piece.
# Prints every prefill position the meter saw.
AT_PIECE = """
import os, signal, sys
from mlx_dspark.cli import common
at, seen = int(sys.argv[1]), []
real = common.PrefillMeter.__call__
def meter(self, done, total, seconds):
    seen.append(done)
    real(self, done, total, seconds)
    if len(seen) == at + 1:
        os.kill(os.getpid(), signal.SIGINT)
common.PrefillMeter.__call__ = meter
sys.argv = ["mlx-dspark"] + sys.argv[2:]
from mlx_dspark.cli import main
code = main()
print("meter:", *seen, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.slow          # subprocesses
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ctrl_c_during_a_piece_stops_the_prefill_at_its_end(command):
    """In tokens, not seconds: the meter sees the piece the Ctrl-C landed in end, and no
    other; the prompt is far from done."""
    argv = GENERATE[1:] if command == "generate" else ["chat", "--speculative", "off"]
    r = subprocess.run([sys.executable, "-c", AT_PIECE, "2"] + argv, input=LONG + "\n",
                       capture_output=True, text=True, timeout=300, env=ENV)
    seen = [int(v) for v in re.search(r"meter: ([\d ]+)\n", r.stderr)[1].split()]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(seen) == 4, seen          # the start, pieces 1 and 2, and the one it landed in
    stop = seen[-1]
    assert 0 < stop - seen[-2] <= PIECE and stop < 2000, seen   # LONG: about 3,000 tokens
    if command == "generate":
        assert r.returncode == 130 and "mlx-dspark generate: interrupted" in r.stderr
    else:               # the message is dropped; the end of the input ends chat
        assert r.returncode == 0, r.stderr
        assert f"(stopped reading the message at {stop} of " in r.stdout, r.stdout
