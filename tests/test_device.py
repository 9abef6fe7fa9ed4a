"""Device housekeeping around a generation (issue 29 item 6), as mlx-lm's generate.py does it:
each step on a generation stream of its own, the wired-memory limit raised while a generation
runs and put back after it, ``mx.clear_cache()`` after the prefill and every CLEAR_EVERY
tokens. On this CPU the wired limit has no backend (a no-op); a Metal-like device is played by
reporting a recommended working set. None of it changes a token, on the main thread or on a
thread of its own (the server's engine)."""

import threading

import mlx.core as mx
import pytest

from mlx_dspark import device
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request
from testkit.toy import random_drafter, tiny_target

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def models():
    """The toy target and a random drafter on it."""
    target = tiny_target(seed=1)
    return target, random_drafter(target)


@pytest.fixture(scope="module")
def target(models):
    return models[0]


@pytest.fixture(scope="module")
def drafter(models):
    return models[1]


def tokens(target, drafter=None, mode="off", n=12):
    return list(decode(Session(target, drafter), Request(PROMPT, max_tokens=n,
                                                         speculative=mode)))


class WiredLimit:
    """A device that reports a recommended working set, and the wired limits set on it."""

    def __init__(self, monkeypatch, size=1 << 30):
        self.limit, self.calls = 0, []
        info = mx.device_info()
        monkeypatch.setattr(mx, "device_info", lambda *a: {
            **info, "max_recommended_working_set_size": size})
        monkeypatch.setattr(mx, "set_wired_limit", self.set)

    def set(self, limit):
        before, self.limit = self.limit, limit
        self.calls.append(limit)
        return before


def test_on_this_cpu_no_wired_limit_is_set(target, monkeypatch):
    assert device.recommended_working_set() is None
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: pytest.fail("set on a CPU"))
    assert len(tokens(target)) == 12


def test_the_wired_limit_is_raised_for_a_generation_and_put_back_after_it(target,
                                                                          monkeypatch):
    wired = WiredLimit(monkeypatch)
    seen = []
    for _ in decode(Session(target), Request(PROMPT, max_tokens=5, speculative="off")):
        seen.append(wired.limit)
    assert seen == [1 << 30] * 5 and wired.calls == [1 << 30, 0]


def test_a_stream_closed_early_or_failing_puts_the_limit_back(target, monkeypatch):
    wired = WiredLimit(monkeypatch)
    stream = decode(Session(target), Request(PROMPT, max_tokens=20, speculative="off"))
    next(stream)
    stream.close()
    assert wired.calls == [1 << 30, 0]
    session = Session(target)
    stream = decode(session, Request(PROMPT, max_tokens=20, speculative="off"))
    next(stream)
    decode(session, Request(PROMPT, max_tokens=2, speculative="off"))   # takes the session
    with pytest.raises(RuntimeError, match="used by another call"):
        next(stream)
    assert wired.limit == 0


def test_interleaved_generations_raise_the_limit_once_and_the_last_puts_it_back(
        target, monkeypatch):
    wired = WiredLimit(monkeypatch)
    a = decode(Session(target), Request(PROMPT, max_tokens=4, speculative="off"))
    b = decode(Session(target), Request(PROMPT, max_tokens=8, speculative="off"))
    next(a), next(b)
    list(a)
    assert wired.limit == 1 << 30
    list(b)
    assert wired.calls == [1 << 30, 0]


def test_models_nearly_filling_the_working_set_warn(target, monkeypatch):
    WiredLimit(monkeypatch, size=device.model_bytes([target]))
    with pytest.warns(ResourceWarning, match="recommended working set"):
        tokens(target, n=2)


def test_model_bytes_counts_a_shared_array_once(target, drafter):
    alone = device.model_bytes([target])
    assert alone == sum(x.nbytes for x in _leaves(target.parameters()))
    assert device.model_bytes([target, target, None]) == alone
    assert device.model_bytes([target, drafter]) > alone


def _leaves(tree):
    from mlx.utils import tree_flatten
    return [x for _, x in tree_flatten(tree)]


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_cache_is_cleared_after_the_prefill_and_every_clear_every_tokens(
        target, drafter, monkeypatch, mode):
    want = tokens(target, drafter, mode, n=11)
    cleared = []
    clear = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: (cleared.append(1), clear()))
    monkeypatch.setattr(device, "CLEAR_EVERY", 4)
    assert tokens(target, drafter, mode, n=11) == want
    assert len(cleared) == 3          # after tokens 1, 5 and 9


def test_steps_run_on_the_generation_stream_and_the_consumer_on_its_own(target, monkeypatch):
    streams = []
    step = type(target).step

    def recording(self, *a, **k):
        streams.append(mx.default_stream(mx.default_device()))
        return step(self, *a, **k)

    monkeypatch.setattr(type(target), "step", recording)
    mine = mx.default_stream(mx.default_device())
    for _ in decode(Session(target), Request(PROMPT, max_tokens=4, speculative="off")):
        assert mx.default_stream(mx.default_device()) == mine
    assert streams and all(s == streams[0] != mine for s in streams)


def on_a_thread(f):
    out = {}

    def run():
        try:
            out["value"] = f()
        except BaseException as e:        # handed to the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_generation_on_another_thread_gives_the_same_tokens(target, drafter, mode):
    # as the server's engine: one thread of its own runs every step of its sessions (a lazy
    # array never crosses threads in MLX 0.32, with or without a generation stream)
    want = tokens(target, drafter, mode)

    def a_chat():
        session = Session(target, drafter)
        first = list(decode(session, Request(PROMPT, max_tokens=4, speculative=mode)))
        return first + list(decode(session, Request(PROMPT + first, max_tokens=8,
                                                    speculative=mode)))

    assert on_a_thread(lambda: tokens(target, drafter, mode)) == want
    assert on_a_thread(a_chat) == want == a_chat()
