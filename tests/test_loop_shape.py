"""The loop's shape for a GPU: serial steps are pipelined (the next one is queued before the
token is read) without changing a token, and a speculative round blocks on the host at most
twice (the one read of drafts + accept count, plus a drafter catch-up after serial steps).
Blocking calls are counted through the public loop by wrapping every way MLX hands a value
to the host."""

import mlx.core as mx
import pytest

from testkit.loop_helpers import sampler_fields
from mlx_dspark.decode import loop as speculative
from mlx_dspark.request import Request
from mlx_dspark.logits.sampling import Noise, Sampler, choose
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.toy import random_drafter, tiny_target

PROMPT = [3, 14, 15, 92, 65, 35]
V = 97


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


def unpipelined(target, prompt, n, sampler, seed):
    """Serial decoding one step at a time, each token read before the next step is built."""
    cache, noise, seq = target.make_cache(), Noise(sampler, seed), list(prompt)
    logits, _ = target.step(mx.array([prompt]), cache)
    for _ in range(n):
        token = choose(sampler, logits[0, -1:], noise.at(len(seq), 1, V)).item()
        seq.append(token)
        logits, _ = target.step(mx.array([[token]]), cache)
    return seq[len(prompt):]


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(1.0, top_p=0.9, scheme="reproducible"),
                                     Sampler(1.0, top_p=0.9, scheme="rejection")],
                         ids=["greedy", "reproducible", "rejection"])
def test_pipelined_serial_decoding_gives_the_unpipelined_tokens(target, sampler):
    out = list(decode(Session(target), Request(PROMPT, max_tokens=20, speculative="off",
                                               seed=5, **sampler_fields(sampler))))
    assert out == unpipelined(target, PROMPT, 20, sampler, 5)


def test_closing_the_stream_early_undoes_the_step_queued_ahead(target):
    session = Session(target)
    stream = decode(session, Request(PROMPT, max_tokens=20, speculative="off"))
    first = [next(stream) for _ in range(6)]
    stream.close()                       # e.g. a stop string found in the text
    assert session.cache.offset == len(session.tokens) == len(PROMPT) + 5
    fresh = target.make_cache()              # the same steps, one at a time
    target.step(mx.array([PROMPT]), fresh)
    for token in first[:5]:
        target.step(mx.array([[token]]), fresh)
    a, _ = target.step(mx.array([[first[5]]]), session.cache)
    b, _ = target.step(mx.array([[first[5]]]), fresh)
    assert mx.array_equal(a, b).item()


class HostReads:
    """Counts every call that makes the host wait for the device."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__array__")

    def __init__(self, monkeypatch):
        self.count = 0

        def counted(f):
            def wrapper(*a, **k):
                self.count += 1
                return f(*a, **k)
            return wrapper

        monkeypatch.setattr(mx, "eval", counted(mx.eval))
        for name in self.METHODS:
            if hasattr(mx.array, name):
                monkeypatch.setattr(mx.array, name, counted(getattr(mx.array, name)))


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(1.0, top_p=0.95, scheme="reproducible"),
                                     Sampler(1.0, scheme="rejection")],
                         ids=["greedy", "reproducible", "rejection"])
def test_a_speculative_round_blocks_at_most_twice_and_once_while_speculating(
        target, monkeypatch, sampler):
    drafter = random_drafter(target)
    reads = HostReads(monkeypatch)
    per_round, round_ = [], speculative._round

    def counted_round(*a, **k):
        before = reads.count
        out = round_(*a, **k)
        per_round.append(reads.count - before)
        return out

    monkeypatch.setattr(speculative, "_round", counted_round)
    stats = Stats()
    list(decode(Session(target, drafter),
                Request(PROMPT, max_tokens=24, num_draft=3, speculative="on", seed=1,
                        **sampler_fields(sampler)), stats))
    assert len(per_round) == stats.rounds > 3
    assert per_round[0] == 2             # the prompt's catch-up, then the round's one read
    assert set(per_round[1:]) == {1}


def test_a_serial_step_blocks_once(target, monkeypatch):
    reads = HostReads(monkeypatch)
    stats = Stats()
    list(decode(Session(target), Request(PROMPT, max_tokens=24, speculative="off"), stats))
    assert stats.serial_steps == 23 and reads.count == 1 + 23     # + the prefill's token


def test_the_host_read_count_sees_a_blocking_call(monkeypatch):
    # the counter has teeth: a round that evaluated its drafts first would be caught
    reads = HostReads(monkeypatch)
    x = mx.arange(3)
    mx.eval(x)
    x.tolist()
    int(x[0])
    if x[1]:
        x[2].item()
    assert reads.count == 5
