"""The Python API checks every argument once (one RequestError naming it), lets one pair be
used from several threads (they take turns), and refuses to resume a generator whose session
another call has changed."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from mlx_dspark import api
from mlx_dspark.request import RequestError
from mlx_dspark.decode.loop import StaleGenerator


@pytest.fixture(scope="module")
def pair():
    return api.load()


@pytest.mark.parametrize("options,param", [
    (dict(num_draft=2.5), "num_draft"), (dict(num_draft=10**8), "num_draft"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[1.5]), "stop"), (dict(stop={"a": 1}), "stop"), (dict(stop=b"x"), "stop"),
    (dict(stop=True), "stop"), (dict(chat="yes"), "chat"),
    (dict(chat_template_kwargs=3), "chat_template_kwargs"),
    (dict(chat=True, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    (dict(seed=1.5), "seed"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(temperature="1"), "temperature"),
    (dict(repetition_penalty=1e-38), "repetition_penalty"),
    (dict(repetition_penalty=1e-45), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"), (dict(speculative="maybe"), "speculative")])
def test_a_bad_argument_is_one_request_error_naming_it(pair, options, param):
    with pytest.raises(RequestError) as e:
        api.generate(pair, "Hello", **{"max_tokens": 2, **options})
    assert e.value.param == param
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompt", [mx.array([1.5, 2.0]), mx.array([[1.0, 2.0]]),
                                    mx.array([True, False])])
def test_an_array_prompt_that_is_not_token_ids_is_refused_as_what_it_is(pair, prompt):
    with pytest.raises(RequestError) as e:
        api.generate(pair, prompt, max_tokens=2)
    assert e.value.param == "prompt" and str(prompt.dtype) in str(e.value)


def test_a_stop_id_and_max_tokens_none_keep_their_documented_meanings(pair):
    assert len(api.generate(pair, "Hello", max_tokens=None, stop=[]).tokens) <= 256
    first = api.generate(pair, "Hello", max_tokens=3).tokens[1]
    assert api.generate(pair, "Hello", max_tokens=8, stop=first).tokens == \
        api.generate(pair, "Hello", max_tokens=1).tokens


def test_threads_sharing_a_pair_take_turns_and_each_gets_its_own_tokens(pair, monkeypatch):
    alone = api.generate(pair, "Hello", max_tokens=24, speculative="on").tokens
    inside, most = [0], [0]
    step = pair.target.step

    def watched(*args, **kw):            # how many threads are in the model at once
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.002)                # lets another thread in, were it not locked out
        try:
            return step(*args, **kw)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(pair.target, "step", watched)
    out = [None] * 4

    def run(i):
        out[i] = api.generate(pair, "Hello", max_tokens=24, speculative="on").tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [alone] * 4
    assert most[0] == 1


def test_a_generator_resumed_after_another_call_used_its_session_raises(pair):
    session = pair.session()
    first = api.stream_generate(pair, "Hello", max_tokens=30, session=session,
                                speculative="off")
    next(first)
    next(first)
    api.generate(pair, "Another prompt", max_tokens=5, session=session, speculative="off")
    with pytest.raises(StaleGenerator):
        next(first)


def test_the_call_that_took_over_a_session_gives_a_fresh_runs_tokens(pair):
    fresh = api.generate(pair, "Another prompt", max_tokens=12, speculative="off").tokens
    session = pair.session()
    first = api.stream_generate(pair, "Hello", max_tokens=30, session=session,
                                speculative="off")
    for _ in range(5):                  # a serial stretch: a step is built ahead
        next(first)
    assert api.generate(pair, "Another prompt", max_tokens=12, session=session,
                        speculative="off").tokens == fresh
    first.close()                       # the stale generator's cleanup leaves it alone
    assert api.generate(pair, "Another prompt", max_tokens=12, session=session,
                        speculative="off").tokens == fresh
