"""The chat template is the model's: a caller sets template variables only, and rendering is
bounded in time (a loop bounded by a variable once ran forever on a core)."""

from __future__ import annotations

import threading
import time

import pytest

from mlx_dspark import api
from mlx_dspark.text.chat_template import TemplateTimeout, check_template_variables, render
from mlx_dspark.request import RequestError

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return api.load().tokenizer


@pytest.mark.parametrize("name", ["chat_template", "tokenize", "add_generation_prompt",
                                  "continue_final_message", "tools", "return_dict",
                                  "tokenizer_kwargs", "messages"])
def test_tokenizer_arguments_and_the_template_itself_are_refused(name):
    with pytest.raises(RequestError) as e:
        check_template_variables({name: True})
    assert e.value.param == "chat_template_kwargs" and name in str(e.value)


def test_template_variables_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template",
                        "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render(tokenizer, MESSAGES, {"greeting": "Hello! "}) == "Hello! Hi"


def test_a_template_that_loops_forever_is_stopped_and_its_thread_ends(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template",
                        "{% for i in range(n) %}{% for j in range(n) %}{% endfor %}"
                        "{% endfor %}")
    before = threading.active_count()
    t0 = time.monotonic()
    with pytest.raises(TemplateTimeout):
        render(tokenizer, MESSAGES, {"n": 100000}, seconds=0.5)
    assert time.monotonic() - t0 < 3
    assert threading.active_count() == before


def test_generate_refuses_a_template_variable_that_is_a_tokenizer_argument():
    pair = api.load()
    with pytest.raises(RequestError) as e:
        api.generate(pair, "Hi", chat=True, max_tokens=2,
                     chat_template_kwargs={"add_generation_prompt": False})
    assert e.value.param == "chat_template_kwargs"
