"""`mlx-dspark chat` shows the model's thinking apart from its answer (dimmed on a terminal,
left out with --hide-thinking), `/think on|off` switches it per answer, and
--thinking-token-budget closes the block so the model answers. The demo pair's template
writes Nemotron's <think> block; its chats think only when asked (its vocabulary spells
<think> in pieces, so mlx-lm's default is off)."""

import subprocess
import sys

import pytest

import mlx_dspark as md

pytestmark = pytest.mark.slow


def chat(stdin: str, *flags) -> list[str]:
    """The answers (the text after each prompt, up to the status line), of a chat fed
    ``stdin``."""
    out = subprocess.run([sys.executable, "-m", "mlx_dspark.cli", "chat", "--temp", "0",
                          *flags], input=stdin, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    turns = out.stdout.split(">>> ")[1:]
    return [t.rsplit("\n[", 1)[0] for t in turns if "\n[" in t]


def test_think_on_shows_the_thinking_and_hide_thinking_leaves_it_out():
    messages = [{"role": "user", "content": "def f(x):"}]
    # 4 tokens: inside the chat-tuned demo target's 5-token '</think>' (tests/test_reasoning.py)
    want = md.generate(md.load(), messages, max_tokens=4,
                       chat_template_kwargs={"enable_thinking": True})
    assert want.reasoning and not want.text
    shown = chat("/think on\ndef f(x):\n", "-m", "4")
    assert shown == [want.reasoning]
    assert chat("/think on\ndef f(x):\n", "-m", "4", "--hide-thinking") == [""]


def test_think_off_answers_without_a_block_and_a_budget_lets_it_answer():
    off = chat("def f(x):\n", "-m", "8")
    want = md.generate(md.load(), [{"role": "user", "content": "def f(x):"}], max_tokens=8)
    assert off == [want.text]
    budget = md.generate(md.load(), [{"role": "user", "content": "def f(x):"}], max_tokens=16,
                         chat_template_kwargs={"enable_thinking": True},
                         thinking_token_budget=2)
    shown = chat("/think on\ndef f(x):\n", "-m", "16", "--thinking-token-budget", "2")
    assert shown == [budget.reasoning + "\n" + budget.text]
