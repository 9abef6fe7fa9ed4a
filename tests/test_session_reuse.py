"""A session reuses whatever it holds that the prompt begins with (issue 33, item 1).

Before: a session reused its tokens only when the prompt extended all of them, so a chat
history re-rendered by the template (which trims the answer's leading newline) prefilled from
nothing, the README's own example printed ``reused_tokens`` 0, and a session given only the
new messages (mlx-lm's ``prompt_cache`` habit) silently started a new conversation. Now the
session keeps its state before each call's last prompt token and continues from it; new
messages continue the conversation the session holds."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.text.tokenizer import prompt_ids

README = Path(__file__).parent.parent / "README.md"
FIRST = [{"role": "user", "content": "Write a function that reverses a string."}]
NEXT = {"role": "user", "content": "Now make it recursive."}


@pytest.fixture(scope="module")
def pair():
    return md.load()


def ids(pair, messages):
    return prompt_ids(pair.tokenizer, messages, True, {})


def edited(answer: str) -> str:
    """The answer as a client sends it back edited (here: its first half), so that the history
    renders otherwise than the session holds after the previous prompt. (The first demo target
    began its answers with a newline the template trims, which did this by itself; the
    chat-tuned one begins with a code fence, which renders as it was generated.)"""
    return answer[: len(answer) // 2]


def state(session) -> list[mx.array]:
    """Every array of the session's target cache and drafter context, and its queued taps."""
    snap = session.snapshot()
    return snap.arrays()


def test_the_readme_python_example_prints_a_positive_reused_tokens():
    block = re.search(r"## Python\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    reused = int(out.getvalue().strip().splitlines()[-1])
    assert reused > 0


@pytest.mark.parametrize("speculative", ["on", "off"])
def test_a_history_the_template_renders_otherwise_continues_from_the_previous_prompt(
        pair, speculative):
    session = pair.session()
    answer = md.generate(pair, FIRST, max_tokens=24, session=session, speculative=speculative)
    history = FIRST + [{"role": "assistant", "content": edited(answer.text)}, NEXT]
    first, held = ids(pair, FIRST), list(session.tokens)
    again = ids(pair, history)
    assert again[:len(held)] != held        # the answer is rendered otherwise: not an extension
    got = md.generate(pair, history, max_tokens=24, session=session, speculative=speculative)
    assert got.stats.reused_tokens == len(first) - 1
    fresh = md.generate(pair, history, max_tokens=24, session=pair.session(),
                        speculative=speculative)
    assert got.tokens == fresh.tokens and fresh.stats.reused_tokens == 0


def test_continuing_from_the_kept_state_gives_the_logits_and_state_of_a_fresh_run(pair):
    """To the bit, against a fresh session cut where this one was (the kept state, then
    before the last token); the cuts depend on the prompts alone. One token is generated and
    never fed, so the state is the prompt's; its logprobs are read off the prompt's logits."""
    session = pair.session()
    answer = md.generate(pair, FIRST, max_tokens=24, session=session, speculative="on")
    prompt = ids(pair, FIRST + [{"role": "assistant", "content": edited(answer.text)}, NEXT])
    got = md.generate(pair, prompt, max_tokens=1, session=session, logprobs=20)
    fresh = pair.session()
    fresh.checkpoints = (len(ids(pair, FIRST)) - 1,)
    cold = md.generate(pair, prompt, max_tokens=1, session=fresh, logprobs=20)
    assert got.stats.reused_tokens == fresh.checkpoints[0] and cold.stats.reused_tokens == 0
    assert got.stats.logprobs == cold.stats.logprobs
    assert session.tokens == fresh.tokens == prompt
    mine, theirs = state(session), state(fresh)
    assert len(mine) == len(theirs) > 0
    assert all(a.shape == b.shape and mx.array_equal(a, b) for a, b in zip(mine, theirs))


def test_the_same_prompt_again_continues_from_before_its_last_token(pair):
    session = pair.session()
    first = md.generate(pair, FIRST, max_tokens=16, session=session, temperature=0.8, seed=5)
    again = md.generate(pair, FIRST, max_tokens=16, session=session, temperature=0.8, seed=5)
    assert again.stats.reused_tokens == len(ids(pair, FIRST)) - 1
    assert again.tokens == first.tokens


def test_ids_that_differ_only_in_the_last_token_continue_from_the_kept_state(pair):
    session = pair.session()
    prompt = ids(pair, FIRST)
    md.generate(pair, prompt, max_tokens=8, session=session)
    branch = prompt[:-1] + [17, 4, 101]
    got = md.generate(pair, branch, max_tokens=8, session=session)
    assert got.stats.reused_tokens == len(prompt) - 1
    assert got.tokens == md.generate(pair, branch, max_tokens=8).tokens


def test_new_messages_alone_continue_the_conversation_the_session_holds(pair):
    """mlx-lm's habit: only the new message goes to the session that holds the rest."""
    habit, whole = pair.session(), pair.session()
    answer = md.generate(pair, FIRST, max_tokens=24, session=habit)
    assert md.generate(pair, FIRST, max_tokens=24, session=whole).text == answer.text
    new_only = md.generate(pair, [NEXT], max_tokens=24, session=habit)
    history = FIRST + [{"role": "assistant", "content": answer.text}, NEXT]
    resent = md.generate(pair, history, max_tokens=24, session=whole)
    assert new_only.stats.prompt_tokens == len(ids(pair, history))
    assert new_only.stats.reused_tokens == resent.stats.reused_tokens > 0
    assert new_only.tokens == resent.tokens
    # a third turn the same way: the held conversation now has both answers
    third = {"role": "user", "content": "And test it."}
    history += [{"role": "assistant", "content": resent.text}, third]
    assert md.generate(pair, [third], max_tokens=8, session=habit).stats.prompt_tokens \
        == len(ids(pair, history))


def test_after_reset_messages_begin_a_new_conversation(pair):
    session = pair.session()
    md.generate(pair, FIRST, max_tokens=8, session=session)
    session.reset()
    got = md.generate(pair, [NEXT], max_tokens=8, session=session)
    assert got.stats.prompt_tokens == len(ids(pair, [NEXT])) and got.stats.reused_tokens == 0


def test_a_prompt_of_text_after_messages_is_the_whole_prompt(pair):
    session = pair.session()
    md.generate(pair, FIRST, max_tokens=8, session=session)
    md.generate(pair, "def f(x):", max_tokens=8, session=session)
    got = md.generate(pair, [NEXT], max_tokens=8, session=session)
    assert got.stats.prompt_tokens == len(ids(pair, [NEXT]))
