"""The ``mlx-dspark`` console script's generate, chat and bench commands, driven for real: chat
through a pseudo-terminal (pexpect), the others as subprocesses, on a fixture pair made by the
real converter from the committed ModelOpt exports (tests/cli_pair.py). The models are random,
so these tests check the commands' behaviour and numbers, not the text."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from testkit.cli_pair import make_pair
from mlx_dspark import cli

# subprocesses and a pseudo-terminal: the slow lane
pytestmark = pytest.mark.slow

SCRIPT = str(Path(sys.executable).parent / "mlx-dspark")
# fp32, where speculative greedy output must equal serial greedy output token for token.
DTYPE = ["--dtype", "float32"]
STATUS = re.compile(r"\[(\d+) tokens, ([\d.]+) tokens/s, accepted ([\d.]+)/round \(([^)]*)\), "
                    r"prompt (\d+) tokens: (\d+) prefilled, (\d+) reused, (\w+), (\w+)\]")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def pair(pair_dirs):
    target, drafter = pair_dirs
    return ["--model", str(target), "--drafter", str(drafter), *DTYPE]


# ---------------------------------------------------------------------------------------------
# chat


def spawn_chat(pair, *extra) -> pexpect.spawn:
    child = pexpect.spawn(SCRIPT, ["chat", *pair, *extra], encoding="utf-8", timeout=60,
                          dimensions=(24, 250))
    child.expect(">>> ")
    return child


def ask(child, text) -> dict:
    """Send one message and wait for the answer; returns its status line."""
    child.sendline(text)
    child.expect(STATUS)
    answer = _status(child.match)
    child.expect(">>> ")
    return answer


def _status(m: re.Match) -> dict:
    g = m.groups()
    return {"generated": int(g[0]), "tokens_per_s": float(g[1]), "accepted": float(g[2]),
            "prompt": int(g[4]), "prefilled": int(g[5]), "reused": int(g[6]), "mode": g[7],
            "finish": g[8]}


def quit_with_eof(child):
    child.sendeof()
    child.expect(pexpect.EOF)
    child.wait()        # its exit, however long after EOF (close() kills a slow one)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


def test_chat_second_turn_prefills_only_the_new_message_and_reset_prefills_all(pair):
    # forced speculation: what "auto" does depends on measured times, and this test compares
    # a fresh start with the first turn
    child = spawn_chat(pair, "--max-tokens", "12", "--speculative", "on")
    child.sendline("/stats")
    child.expect("no answers yet")
    child.expect(">>> ")
    first = ask(child, "What is the capital of France?")
    assert first["reused"] == 0 and first["prefilled"] == first["prompt"]
    assert first["generated"] == 12 and first["finish"] == "length"

    second = ask(child, "And of Italy?")
    # Everything the first turn fed (its prompt and all but the last answer token, which was
    # emitted, never fed) is reused; only the new message and its template framing are prefilled.
    assert second["reused"] == first["prompt"] + first["generated"] - 1
    assert second["prefilled"] == second["prompt"] - second["reused"]
    assert 0 < second["prefilled"] < len("</s>\n<|user|>\nAnd of Italy?\n<|assistant|>\n") + 16

    child.sendline("/stats")
    child.expect(r"prompt: (\d+) tokens, (\d+) prefilled")     # the --stats lines, summed
    assert int(child.match.group(1)) == first["prompt"] + second["prompt"]
    assert int(child.match.group(2)) == first["prefilled"] + second["prefilled"]
    child.expect(r"peak memory: ([\d.]+) GB \(MLX\), process peak RSS ([\d.]+) GB")
    assert float(child.match.group(1)) > 0 and float(child.match.group(2)) > 0
    child.expect(">>> ")

    child.sendline("/reset")
    child.expect(r"\(conversation cleared\)")
    child.expect(">>> ")
    again = ask(child, "What is the capital of France?")
    assert again == {**first, "tokens_per_s": again["tokens_per_s"]}   # a fresh start

    child.sendline("/help")
    for name in ("/reset", "/stats", "/help", "/quit"):
        child.expect(re.escape(name))
    child.expect(">>> ")
    child.sendline("/frobnicate")
    child.expect(r"unknown command /frobnicate; /help lists the commands")
    child.expect(">>> ")
    quit_with_eof(child)


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(pair):
    # A long answer: the fixture's context (512 positions) would take tens of seconds to fill.
    child = spawn_chat(pair, "--max-tokens", "100000")
    child.sendline("Tell me a very long story.")
    child.expect(r"Tell me a very long story\.\r\n")
    child.expect(r"\S{6}")                            # the answer is streaming
    t0 = time.monotonic()
    child.sendintr()
    child.expect(STATUS, timeout=10)
    stopped = _status(child.match)
    assert time.monotonic() - t0 < 5
    assert stopped["finish"] == "interrupted" and 1 <= stopped["generated"] < 400
    child.expect(">>> ")

    # The interrupted answer stays in the conversation, and the session still holds it.
    child.sendline("Go on.")
    child.expect(r"Go on\.\r\n")
    child.expect(r"\S{3}")
    child.sendintr()
    child.expect(STATUS, timeout=10)
    nxt = _status(child.match)
    assert nxt["reused"] == stopped["prompt"] + stopped["generated"] - 1
    child.expect(">>> ")

    child.sendintr()                                  # Ctrl-C at the prompt does not quit
    child.expect(r"Ctrl-D or /quit exits")
    child.expect(">>> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.wait()        # its exit, however long after EOF (close() kills a slow one)
    child.close()
    assert child.exitstatus == 0


# chat without GNU readline (macOS's libedit, or none): what reaches input() is the terminal's
NO_READLINE = ("import runpy, sys; sys.modules['readline'] = None; "
               "runpy.run_module('mlx_dspark.cli', run_name='__main__')")
PASTED = "def reverse(s):\n    return s[::-1]\nTest it."


@pytest.mark.parametrize("editor", ["readline", "none"])
def test_chat_takes_a_pasted_block_as_one_message(pair, pair_dirs, editor):
    """Issue 33: each pasted line was a turn. Chat turns the terminal's bracketed paste on and
    takes what comes between its marks as one message."""
    from mlx_dspark import api
    if editor == "readline":
        child = spawn_chat(pair, "--max-tokens", "4")
    else:
        child = pexpect.spawn(sys.executable, ["-c", NO_READLINE, "chat", *pair,
                                               "--max-tokens", "4"],
                              encoding="utf-8", timeout=60, dimensions=(24, 250))
        child.expect(">>> ")
    assert "\x1b[?2004h" in child.before               # bracketed paste on, before the prompt
    child.send("\x1b[200~" + PASTED.replace("\n", "\r") + "\x1b[201~")
    child.send("\r")
    child.expect(STATUS)
    answer = _status(child.match)
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"turns: (\d+),")
    assert child.match.group(1) == "1"
    child.expect(">>> ")
    quit_with_eof(child)
    pair = api.load(*pair_dirs, dtype="float32", warm=False)
    whole = api.make_request(pair, [{"role": "user", "content": PASTED}])
    assert answer["prompt"] == len(whole.prompt)       # all three lines, in one message


# ---------------------------------------------------------------------------------------------
# generate


STATS_LINES = {
    "mode": r"(serial|speculative) \(requested (auto|on|off), (\d+) switches\)",
    "prompt": r"(\d+) tokens, (\d+) prefilled, ([\d.]+) tokens/s",
    "generation": r"(\d+) tokens, ([\d.]+) tokens/s",
    "rounds": r"(\d+) speculative, (\d+) serial",
    "mean accepted per round": r"([\d.]+)",
    "acceptance by position": r"((?:[\d.]+|-)(?: (?:[\d.]+|-))*)",
    "finish": r"(length|stop|context)",
    "peak memory": r"([\d.]+) GB \(MLX\), process peak RSS ([\d.]+) GB",
}


def parse_stats(stderr: str) -> dict:
    """The --stats block: '==========' then one 'name: value' line per STATS_LINES entry."""
    block = stderr[stderr.index("==========\n") + 11:].strip().splitlines()
    fields = dict(line.split(": ", 1) for line in block)
    assert list(fields) == list(STATS_LINES)
    return {k: re.fullmatch(STATS_LINES[k], v).groups() for k, v in fields.items()}


def run(*argv, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *argv], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_generate_stats_parse_and_agree_with_the_run(pair):
    p = run("generate", *pair, "--prompt", "def fibonacci(n):", "--max-tokens", "20",
            "--speculative", "on", "--num-draft", "2", "--stats")
    assert p.returncode == 0, p.stderr
    s = parse_stats(p.stderr)
    assert s["mode"][:2] == ("speculative", "on")
    generated = int(s["generation"][0])
    assert generated == 20 and s["finish"] == ("length",)
    assert int(s["prompt"][0]) == int(s["prompt"][1]) > 0
    rounds, serial = map(int, s["rounds"])
    acceptance = s["acceptance by position"][0].split()
    assert len(acceptance) == 2
    assert all(a == "-" or 0.0 <= float(a) <= 1.0 for a in acceptance)
    accepted = float(s["mean accepted per round"][0])
    # every generated token is the prefill's, a serial step's or part of a round
    assert generated == 1 + serial + rounds + round(accepted * rounds)
    assert float(s["generation"][1]) > 0
    assert p.stdout.endswith("\n") and len(p.stdout) > 1


def test_generate_names_the_context_limit_as_the_finish(pair):
    """Issue 33: a run the context limit (the fixture's 512 positions) ended said `length`."""
    p = run("generate", *pair, "--ignore-chat-template", "-p", "x = 1\n" * 120,
            "--max-tokens", "400", "--speculative", "off", "--stats")
    assert p.returncode == 0, p.stderr
    s = parse_stats(p.stderr)
    assert s["finish"] == ("context",)
    assert int(s["prompt"][0]) + int(s["generation"][0]) == 512


def test_generate_reads_stdin_and_streams_the_api_text(pair, pair_dirs):
    p = run("generate", *pair, "--max-tokens", "16", "--chat", stdin="Tell me a joke.")
    assert p.returncode == 0, p.stderr

    import mlx.core as mx
    import mlx_dspark as md

    target, drafter = pair_dirs
    loaded = md.load(target, drafter, dtype=mx.float32)
    want = md.generate(loaded, "Tell me a joke.", max_tokens=16, chat=True)
    assert p.stdout == want.text + "\n"


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_json_has_the_documented_fields(pair):
    p = run("bench", *pair, "--json", "--limit", "1", "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    assert "bench: warming up" in p.stderr and "[9/9]" in p.stderr   # progress on stderr
    r = json.loads(p.stdout)
    assert set(r) == {"machine", "settings", "prompts", "domains", "overall", "bandwidth",
                      "model", "drafter"}
    assert set(r["machine"]) == {"system", "machine", "cpu_count", "mlx", "device", "blas"}
    assert r["settings"] == {"max_tokens": 8, "num_draft": 3, "repeats": 3, "temperature": 0.0,
                             "top_p": 1.0, "sampling": "rejection", "dtype": "float32"}
    assert [row["domain"] for row in r["prompts"]] == ["code", "math", "chat"]
    assert set(r["domains"]) == {"code", "math", "chat"}
    summaries = [*r["prompts"], *r["domains"].values(), r["overall"]]
    for s in summaries:
        assert set(s) >= {"prompts", "same_tokens", "tokens_per_s", "speedup",
                          "predicted_speedup", "efficiency", "auto_vs_serial", "auto_vs_best",
                          "auto_speculative_share", "auto_picked_faster", "auto_did",
                          "mean_tokens_per_round", "acceptance_by_position", "serial_step_ms",
                          "round_ms", "overhead_ms_per_round", "overhead_share", "spread",
                          "verdict", "prefill_tokens_per_s", "ttft_ms", "peak_memory_gb"}
        t, sp = s["tokens_per_s"], s["spread"]
        assert set(t) == {"serial", "speculative", "auto"} and min(t.values()) > 0
        assert sp["kind"] == "min-max over the repeats" and sp["repeats"] == 3
        for key in ("tokens_per_s", "prefill_tokens_per_s", "ttft_ms", "peak_memory_gb"):
            for m, v in s[key].items():
                assert 0 < sp[key][m][0] <= v <= sp[key][m][1], (key, m)
        for key in ("speedup", "auto_vs_serial", "efficiency"):
            assert 0 < sp[key][0] <= s[key] <= sp[key][1], key
        # the verdict: a winner only where every repeat says so (the spread leaves out 1.0)
        for mode, ratio in (("speculative", "speedup"), ("auto", "auto_vs_serial")):
            lo, hi = sp[ratio]
            want = ("within noise" if lo <= 1 <= hi else "faster" if lo > 1 else "slower")
            assert s["verdict"][mode] == want
        assert s["auto_picked_faster"] in (True, False, None)
        assert s["auto_did"]["generations"] == 3 * s["prompts"]
        assert len(s["acceptance_by_position"]) == 3
        assert set(s["round_ms"]) == {"draft", "verify", "rollback", "round"}
        # lossless: greedy speculative output is serial output, token for token (fp32)
        assert s["same_tokens"] == s["prompts"]
        assert s["peak_memory_gb"]["serial"] * 1e9 > r["bandwidth"]["weight_bytes_per_token"]
    assert r["overall"]["prompts"] == 3
    assert all(row["prompt_tokens"] > 0 for row in r["prompts"])
    b = r["bandwidth"]
    assert b["weight_bytes_per_token"] > 0 and b["memcpy_gb_per_s"] > 0
    assert b["serial_gb_per_s"] == pytest.approx(
        b["weight_bytes_per_token"] * r["overall"]["tokens_per_s"]["serial"] / 1e9)


# ---------------------------------------------------------------------------------------------
# errors: one line, exit 1, no traceback (in-process: the real main, no model to run)


def one_line_error(capsys, argv) -> str:
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_missing_model_directory(capsys, tmp_path):
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path / "nope"), "-p", "x"])
    assert err.startswith("mlx-dspark generate: error: ") and "nope: no such model directory" in err


def test_drafter_for_another_target(capsys, pair_dirs, tmp_path):
    target, drafter = pair_dirs
    other = tmp_path / "other_drafter"
    shutil.copytree(drafter, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 512
    (other / "config.json").write_text(json.dumps(cfg))
    err = one_line_error(capsys, ["chat", "--model", str(target), "--drafter", str(other)])
    assert "vocab_size 512" in err and "config.json" in err


def test_corrupt_checkpoint(capsys, pair_dirs, tmp_path):
    target, drafter = pair_dirs
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = one_line_error(capsys, ["bench", "--model", str(broken), "--drafter", str(drafter)])
    assert "model.safetensors" in err


def test_missing_demo_pair_is_named(capsys, monkeypatch, tmp_path):
    from mlx_dspark import loading
    monkeypatch.setattr(loading, "DEMO", tmp_path / "demo")
    err = one_line_error(capsys, ["generate", "-p", "x"])
    assert "embedded demo pair is not installed" in err and "--model" in err


def test_no_model_means_the_embedded_demo_pair(capsys, monkeypatch, pair_dirs):
    import mlx_dspark as md
    from mlx_dspark import loading

    target, drafter = pair_dirs
    monkeypatch.setattr(loading, "DEMO", target.parent)    # holds target/ and drafter/, as demo/ does
    assert cli.main(["generate", "-p", "def f(x):", "--max-tokens", "6"]) == 0
    # the fixture tokenizer has a chat template, which generate applies by default
    want = md.generate(md.load(target, drafter), "def f(x):", max_tokens=6, chat=True)
    assert capsys.readouterr().out == want.text + "\n"


def test_chat_needs_a_chat_template(capsys, pair_dirs, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(pair_dirs[0], plain)
    (plain / "chat_template.jinja").unlink()
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    for argv in (["chat"], ["generate", "--chat", "-p", "hi"]):
        # edited after conversion, so past its receipt
        err = one_line_error(capsys, [*argv, "--model", str(plain), "--verify", "none"])
        assert "no chat template" in err and "`mlx-dspark generate` without --chat" in err


def test_prompt_longer_than_the_context(capsys, pair):
    err = one_line_error(capsys, ["generate", *pair, "-p", "The quick brown fox. " * 200])
    assert "context limit is 512" in err

def test_speculative_on_without_a_drafter(capsys, pair_dirs):
    target, _ = pair_dirs
    err = one_line_error(capsys, ["generate", "--model", str(target), "--speculative", "on",
                                  "-p", "x"])
    assert "needs a drafter" in err


def test_bench_without_a_drafter(capsys, pair_dirs):
    err = one_line_error(capsys, ["bench", "--model", str(pair_dirs[0])])
    assert "pass --drafter DIR" in err

def test_num_draft_beyond_the_drafter_block(capsys, pair):
    err = one_line_error(capsys, ["generate", *pair, "--num-draft", "9", "-p", "x"])
    assert "--num-draft 9" in err and "at most 7" in err


def test_plot_without_matplotlib_is_refused_before_running(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import fails as if not installed
    err = one_line_error(capsys, ["bench", "--plot", "out.png", "--model", "/nonexistent"])
    assert "--plot needs matplotlib" in err


# ---------------------------------------------------------------------------------------------
# the chat's prompt building, on the fixture's real tokenizer (no model needed)


@pytest.fixture(scope="module")
def tokenizer(pair_dirs):
    from mlx_dspark.text.tokenizer import load_tokenizer
    return load_tokenizer(pair_dirs[0])


def test_next_turn_prompt_extends_the_previous_ids_exactly(tokenizer):
    from mlx_dspark.cli.chat import Conversation

    conv = Conversation(tokenizer, {})
    first = conv.prompt("What is the capital of France?")
    answer = tokenizer.encode("Paris", add_special_tokens=False) + [7, 250]  # any ids, even odd
    conv.add_turn("What is the capital of France?", first, answer, "Paris?")
    second = conv.prompt("And of Italy?")
    assert second[:len(first) + len(answer)] == first + answer
    # what follows is the template's text after an answer: end of turn, message, reply header
    tail = tokenizer.decode(second[len(first) + len(answer):])
    assert tail == "</s>\n<|user|>\nAnd of Italy?\n<|assistant|>\n<think></think>"
    conv.reset()
    assert conv.prompt("What is the capital of France?") == first


def test_reasoning_switch_reaches_the_template(tokenizer, capsys):
    from mlx_dspark.cli.chat import Conversation
    from mlx_dspark.text.tokenizer import template_options

    on, off = template_options(tokenizer, "on"), template_options(tokenizer, "off")
    assert on == {"enable_thinking": True} and off == {"enable_thinking": False}
    text = lambda opts: tokenizer.decode(Conversation(tokenizer, opts).prompt("Hi"))
    assert text(on) == "<|user|>\nHi\n<|assistant|>\n"
    assert text(off) == "<|user|>\nHi\n<|assistant|>\n<think></think>"

    class NoSwitch:
        chat_template = "{{ messages }}"
    assert template_options(NoSwitch(), "on") == {}
    assert "no reasoning switch" in capsys.readouterr().err


def test_api_and_cli_share_one_chat_encoder_with_template_options(tokenizer):
    from mlx_dspark.cli.chat import Conversation
    from mlx_dspark.text.tokenizer import prompt_ids

    off = {"enable_thinking": False}
    ids = prompt_ids(tokenizer, "Hi", chat=True, options=off)      # what stream_generate uses
    assert tokenizer.decode(ids) == "<|user|>\nHi\n<|assistant|>\n<think></think>"
    assert ids == Conversation(tokenizer, off).prompt("Hi")
    assert prompt_ids(tokenizer, "Hi", chat=True) == Conversation(tokenizer, {}).prompt("Hi")


def test_triple_quoted_message_keeps_its_lines_and_indentation(monkeypatch):
    from mlx_dspark.cli.chat import _read_block

    lines = iter(["def f(x):", "    return x", '"""'])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert _read_block("") == "def f(x):\n    return x"
    assert _read_block('all on one line"""') == "all on one line"


@pytest.mark.parametrize("argv,name", [
    (["--temp", "-1"], "--temp"), (["--temp", "nan"], "--temp"), (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"), (["--min-p", "2"], "--min-p"),
    (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--repetition-context-size", "0"], "--repetition-context-size"),
    (["--presence-penalty", "3"], "--presence-penalty"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty")])
def test_nonsense_sampling_options_are_one_line_before_loading(capsys, argv, name):
    # /nonexistent is never reached: the options are checked before the model is loaded
    err = one_line_error(capsys, ["generate", "--model", "/nonexistent", "-p", "x", *argv])
    assert err.startswith(f"mlx-dspark generate: error: {name} must")


def test_penalty_flags_reach_the_request_and_give_serial_text_when_speculating(pair):
    base = ["generate", *pair, "-p", "def f(x):", "--max-tokens", "24",
            "--ignore-chat-template"]
    flags = ["--repetition-penalty", "1.5", "--repetition-context-size", "8",
             "--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--min-p", "0.1"]
    outs = [run(*base, *flags, "--speculative", mode) for mode in ("on", "off")]
    assert all(p.returncode == 0 for p in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout
    assert run(*base, "--speculative", "off").stdout != outs[1].stdout


def test_a_seed_reproduces_generate_output_with_and_without_speculation(pair):
    args = ["generate", *pair, "-p", "def f(x):", "--max-tokens", "16", "--temp", "0.9",
            "--seed", "5", "--sampling", "reproducible"]
    outs = {run(*args, "--speculative", mode).stdout for mode in ("on", "off", "auto")}
    assert len(outs) == 1
