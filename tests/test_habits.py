"""What an mlx-lm user tries first works (issue 15): ``-m``, ``--version``, ``--system-prompt``,
the chat template by default in ``generate``, peak memory in the stats, ``speculative="on"``,
``dir(mlx_dspark)``, and mlx-lm's streaming convention (the finish reason on the last token's
chunk, no trailing chunk without a token). Run on the embedded demo pair, greedy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.request import Request, RequestError
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def pair():
    return md.load()


def run_cli(capsys, *argv) -> tuple[str, str]:
    assert cli.main(list(argv)) == 0
    out = capsys.readouterr()
    return out.out, out.err


def stats_lines(err: str) -> dict:
    return dict(line.split(": ", 1) for line in err.splitlines() if ": " in line)


# ---------------------------------------------------------------------------------------------
# command line


def test_dash_m_is_max_tokens(capsys):
    _, err = run_cli(capsys, "generate", "-p", PROMPT, "-m", "5", "--speculative", "off",
                     "--stats")
    assert stats_lines(err)["generation"].startswith("5 tokens,")
    for command in ("chat", "bench"):
        assert cli.build_parser().parse_args([command, "-m", "7"]).max_tokens == 7


def test_version_prints_the_package_version_which_is_pyprojects(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"mlx-dspark {md.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == md.__version__


def test_generate_applies_the_chat_template_by_default_and_can_ignore_it(pair, capsys):
    assert pair.tokenizer.has_chat_template
    args = ["generate", "-p", PROMPT, "-m", "12", "--speculative", "off"]
    templated, _ = run_cli(capsys, *args)
    chat, _ = run_cli(capsys, *args, "--chat")           # still accepted: explicit "on"
    plain, _ = run_cli(capsys, *args, "--ignore-chat-template")
    assert templated == chat == md.generate(pair, PROMPT, max_tokens=12, chat=True).text + "\n"
    assert plain == md.generate(pair, PROMPT, max_tokens=12).text + "\n"
    assert templated != plain


@pytest.mark.parametrize("flag", ["--system-prompt", "--system"])
def test_generate_puts_the_system_prompt_before_the_user_message(pair, capsys, flag):
    system = "You write Python."
    out, err = run_cli(capsys, "generate", "-p", PROMPT, "-m", "12", "--speculative", "off",
                       "--stats", flag, system)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
    want = md.generate(pair, messages, max_tokens=12)
    assert out == want.text + "\n"
    prompt_tokens = int(stats_lines(err)["prompt"].split()[0])
    assert prompt_tokens == want.stats["prompt_tokens"] > \
        md.generate(pair, PROMPT, max_tokens=1, chat=True).stats["prompt_tokens"]


def test_chat_takes_system_prompt_and_its_old_spelling(pair):
    from mlx_dspark.cli.chat import Chat
    for flag in ("--system-prompt", "--system"):
        args = cli.build_parser().parse_args(["chat", flag, "Be brief."])
        conversation = Chat(pair, args).conversation
        assert conversation.messages == [{"role": "system", "content": "Be brief."}]


def test_system_prompt_with_ignore_chat_template_is_one_clear_error(capsys):
    assert cli.main(["generate", "-p", "x", "--system-prompt", "s",
                     "--ignore-chat-template"]) == 1
    err = capsys.readouterr().err
    assert err == ("mlx-dspark generate: error: --system-prompt applies to the chat template: "
                   "drop --ignore-chat-template\n")


def test_stats_report_peak_memory_at_least_the_weights(pair, capsys):
    from mlx.utils import tree_flatten
    weights = sum(v.nbytes for _, v in tree_flatten(pair.target.parameters())) / 1e9
    res = md.generate(pair, PROMPT, max_tokens=4)
    assert res.stats["peak_memory_gb"] >= weights > 0
    assert res.stats["peak_rss_gb"] > 0
    _, err = run_cli(capsys, "generate", "-p", PROMPT, "-m", "4", "--verbose")
    line = stats_lines(err)["peak memory"]
    assert line.endswith(" GB") and "(MLX), process peak RSS" in line
    assert float(line.split()[0]) >= weights
    # mlx-lm's --verbose takes a boolean; ours is off by default, so only False silences it
    verbose = [cli.build_parser().parse_args(["generate", *a]).stats
               for a in ([], ["--verbose"], ["--verbose", "False"], ["--verbose", "T"])]
    assert verbose == [False, True, False, True]


# ---------------------------------------------------------------------------------------------
# Python API


def test_speculative_takes_the_cli_words_in_python(pair):
    on = md.generate(pair, PROMPT, max_tokens=16, speculative="on")
    off = md.generate(pair, PROMPT, max_tokens=16, speculative="off")
    assert on.tokens == md.generate(pair, PROMPT, max_tokens=16, speculative=True).tokens
    assert on.stats["rounds"] > 0 and off.stats["rounds"] == 0
    assert on.tokens == off.tokens                         # greedy: lossless
    # The mode belongs to each call: a session takes none (a legacy one warns and is
    # ignored) and always carries the pair's drafter; one without a drafter refuses "on".
    assert pair.session().drafter is pair.drafter
    with pytest.warns(DeprecationWarning, match="no longer takes a mode"):
        assert pair.session("off").drafter is pair.drafter
    assert md.generate(pair, PROMPT, max_tokens=16, speculative="off",
                       session=pair.session()).tokens == off.tokens
    with pytest.raises(RequestError, match="speculative 'on' needs a drafter") as e:
        md.generate(pair, PROMPT, max_tokens=4, speculative="on",
                    session=Session(pair.target, home=pair))
    assert e.value.param == "speculative"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="'auto', 'on', 'off', True or False"):
            md.generate(pair, PROMPT, max_tokens=4, speculative=bad)


def test_dir_lists_the_public_api():
    names = ["load", "generate", "stream_generate", "load_target", "load_drafter", "Pair",
             "Result", "Chunk", "Request", "Session", "Stats", "__version__"]
    assert set(names) <= set(dir(md)) and set(md.__all__) == set(names)
    for name in md.__all__:
        assert getattr(md, name) is not None
    assert md.Chunk.__module__ == "mlx_dspark.text.stream"     # the chunk stream, below serve
    assert md.Request is Request and md.Session is Session
    assert md.Stats.__module__ == "mlx_dspark.stats"


# ---------------------------------------------------------------------------------------------
# streaming convention


def expected(pair, prompt, max_tokens, speculative, stop):
    """generate()'s result rebuilt from the raw decoding loop, the way it was defined before
    the streaming change: the stop token left out, a stop string cutting the text and the
    tokens after the one that completed it."""
    tok = pair.tokenizer
    strings = [s for s in stop if isinstance(s, str)]
    stop_ids = set(tok.eos_token_ids) | {s for s in stop if isinstance(s, int)}
    ids = list(tok.encode(prompt))
    raw = list(decode(Session(pair.target, pair.drafter),
                      Request(ids, max_tokens=max_tokens, speculative=speculative,
                              stop_tokens=stop_ids)))
    if raw and raw[-1] in stop_ids:
        raw.pop()
    for k in range(1, len(raw) + 1):
        text = tok.decode(raw[:k])
        hits = [text.find(s) for s in strings if s in text]
        if hits:
            return text[:min(hits)], raw[:k], "stop"
    return tok.decode(raw), raw, "stop" if len(raw) < max_tokens else "length"


def stream(pair, prompt, **kwargs):
    return list(md.stream_generate(pair, prompt, **kwargs))


@pytest.mark.parametrize("speculative", [True, False])
def test_generate_text_and_tokens_are_the_raw_loops_with_any_kind_of_stop(pair, speculative):
    full = md.generate(pair, PROMPT, max_tokens=24, speculative=False)
    k = next(i for i in range(3, 24) if full.tokens[i] not in full.tokens[:i])
    cases = [[], [full.tokens[k]], [full.text[len(full.text) // 2:][:4]],
             # a stop string the text only starts: held back while streaming, then delivered
             [full.text[-3:] + "\x01never"]]
    for stop in cases:
        want = expected(pair, PROMPT, 24, speculative, stop)
        res = md.generate(pair, PROMPT, max_tokens=24, speculative=speculative, stop=stop)
        assert (res.text, res.tokens, res.finish_reason) == want, stop
        chunks = stream(pair, PROMPT, max_tokens=24, speculative=speculative, stop=stop)
        assert "".join(c.text for c in chunks) == res.text


def test_the_last_chunk_is_the_last_tokens_and_carries_the_finish_reason(pair):
    chunks = stream(pair, PROMPT, max_tokens=20)
    assert len(chunks) == 20 and all(isinstance(c.token, int) for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * 19 + ["length"]
    assert [c.token for c in chunks] == md.generate(pair, PROMPT, max_tokens=20).tokens


def test_a_stop_token_ends_the_stream_on_its_own_chunk_as_in_mlx_lm(pair):
    full = md.generate(pair, PROMPT, max_tokens=40)
    k = next(i for i in range(3, 40) if full.tokens[i] not in full.tokens[:i])
    chunks = stream(pair, PROMPT, max_tokens=40, stop=[full.tokens[k]])
    assert [c.token for c in chunks] == full.tokens[:k + 1]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].text == ""
    assert md.generate(pair, PROMPT, max_tokens=40, stop=[full.tokens[k]]).tokens == \
        full.tokens[:k]


def test_a_held_back_tail_comes_with_the_last_tokens_chunk(pair):
    full = md.generate(pair, PROMPT, max_tokens=24)
    tail = full.text[-3:]
    chunks = stream(pair, PROMPT, max_tokens=24, stop=[tail + "\x01never"])
    assert chunks[-1].text.endswith(tail) and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == full.text


@pytest.mark.parametrize("speculative", [True, False])
def test_decode_names_the_finish_reason_just_before_the_last_token(speculative):
    # what lets stream_generate put the finish reason on the last token's chunk, for each way
    # a run ends: max_tokens, the context limit, a stop token
    from mlx_dspark.stats import Stats
    from testkit.toy import random_drafter, tiny_target
    target = tiny_target(max_position_embeddings=24)
    drafter = random_drafter(target)
    prompt = list(range(1, 11))

    def run(**kwargs):
        stats = Stats()
        seen = [(t, stats.finish_reason) for t in decode(
            Session(target, drafter), Request(prompt, speculative=speculative, **kwargs),
            stats)]
        return [t for t, _ in seen], [f for _, f in seen]

    tokens, reasons = run(max_tokens=6)
    assert len(tokens) == 6 and reasons == [None] * 5 + ["length"]
    tokens, reasons = run(max_tokens=100)               # 24 positions: 10 prompt, 14 generated
    assert len(tokens) == 14 and reasons == [None] * 13 + ["length"]
    k = next(i for i in range(2, 14) if tokens[i] not in tokens[:i])
    stopped, reasons = run(max_tokens=100, stop_tokens={tokens[k]})
    assert stopped == tokens[:k + 1] and reasons == [None] * k + ["stop"]


@pytest.mark.parametrize("word", ["q", "quit", "exit", " q "])
def test_q_quit_and_exit_leave_chat_as_in_mlx_lm_chat(pair, monkeypatch, word):
    """Issue 41: ``q`` was sent to the model as a message."""
    from mlx_dspark.cli import chat
    lines = iter([word, "never sent"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    sent = []
    monkeypatch.setattr(chat.Chat, "answer", lambda self, line: sent.append(line))
    session = chat.Chat(pair, cli.build_parser().parse_args(["chat"]))
    assert session._run() == 0 and sent == []
    assert next(lines) == "never sent"


def test_ctrl_d_leaves_chat_and_a_longer_message_is_sent(pair, monkeypatch):
    from mlx_dspark.cli import chat
    lines = iter(["quit now", "q"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    sent = []
    monkeypatch.setattr(chat.Chat, "answer", lambda self, line: sent.append(line))
    assert chat.Chat(pair, cli.build_parser().parse_args(["chat"]))._run() == 0
    assert sent == ["quit now"]

    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert chat.Chat(pair, cli.build_parser().parse_args(["chat"]))._run() == 0


def test_print_pair_is_one_line_naming_target_and_drafter(pair, capsys):
    """Issue 41: ``print(pair)`` printed about 100 lines (every module of both models)."""
    print(pair)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and len(out) < 200
    assert out.startswith(f"Pair({pair.path}, ") and pair.drafter_note in out
