"""The speculative loop on a real (tiny, random, fp32) Nemotron-H target: greedy speculation
reproduces serial greedy decoding token for token, and stops, max_tokens, context limits and
session reuse behave exactly as in serial decoding."""

import mlx.core as mx
import pytest

from testkit.loop_helpers import serial_greedy, top2_gap
from mlx_dspark.request import Request, RequestError
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter, tiny_target

# A greedy divergence is only legitimate where the target's own top-2 logits are this close:
# the verify pass (N+1 positions) and a serial step compute the same math in a different
# order; in fp32 on this model the logits agree to ~1e-6 (see the target tests).
TIE = 1e-4
V = 97
PROMPTS = [[5], [3, 14, 15, 92, 65], list(range(1, 18)), [(7 * i) % 90 + 3 for i in range(40)]]
LENGTH = 24


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def refs(target):
    return [(p, serial_greedy(target, p, LENGTH)) for p in PROMPTS]


def assert_same_up_to_near_tie(target, prompt, out, ref):
    """Identical tokens, or a first divergence where the target's top-2 logits nearly tie."""
    assert len(out) == len(ref)
    diff = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if diff is not None:
        gap = top2_gap(target, prompt + ref[:diff])
        assert gap < TIE, f"diverged at token {diff} with a top-2 logit gap of {gap:.3g}"


@pytest.mark.parametrize("n", range(1, 8))
def test_speculative_greedy_equals_serial_greedy_for_every_draft_length(target, refs, n):
    # acceptance 0.5/0.9 alternately: rejections at every position and full acceptances
    accepted = drafted = 0
    for k, (prompt, ref) in enumerate(refs):
        drafter = OracleDrafter(prompt + ref, V, acceptance=0.9 if (n + k) % 2 else 0.5, seed=n)
        stats = Stats()
        out = list(decode(Session(target, drafter),
                          Request(prompt, max_tokens=LENGTH, num_draft=n, speculative="on"),
                          stats))
        assert_same_up_to_near_tie(target, prompt, out, ref)
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert 0 < accepted < drafted          # both branches of the rollback were exercised


def test_speculative_greedy_with_a_random_drafter_equals_serial(target, refs):
    drafter = random_drafter(target)
    for prompt, ref in refs:
        out = list(decode(Session(target, drafter),
                          Request(prompt, max_tokens=LENGTH, num_draft=3, speculative="on")))
        assert_same_up_to_near_tie(target, prompt, out, ref)


def test_a_stop_token_inside_an_accepted_run_ends_output_with_serial_state(target, refs):
    prompt, ref = refs[1]
    k = next(i for i in range(3, LENGTH) if ref[i] not in ref[:i])   # first occurrence
    drafter = OracleDrafter(prompt + ref, V, acceptance=1.0)
    session, stats = Session(target, drafter), Stats()
    out = list(decode(session, Request(prompt, max_tokens=LENGTH, num_draft=7,
                                       speculative="on", stop_tokens={ref[k]}), stats))
    assert out == ref[:k + 1]
    assert stats.finish_reason == "stop"
    assert stats.rounds == 1 and stats.accepted == 7     # the stop was accepted mid-run
    # The stop token is emitted, never fed: the state is the serial one after the same output.
    serial = Session(target)
    assert list(decode(serial, Request(prompt, max_tokens=LENGTH, speculative="off",
                                       stop_tokens={ref[k]}))) == out
    assert session.tokens == serial.tokens == prompt + ref[:k]
    a, _ = target.step(mx.array([[ref[k]]]), session.cache)
    b, _ = target.step(mx.array([[ref[k]]]), serial.cache)
    assert mx.array_equal(a, b).item()


def test_max_tokens_landing_mid_round_gives_exactly_max_tokens(target, refs):
    prompt, ref = refs[2]
    for m in range(1, 10):
        drafter = OracleDrafter(prompt + ref, V, acceptance=1.0)
        stats = Stats()
        out = list(decode(Session(target, drafter),
                          Request(prompt, max_tokens=m, num_draft=3, speculative="on"), stats))
        assert out == ref[:m]
        assert stats.finish_reason == "length" and stats.generated == m
    # max_tokens 0 asks for nothing: a request refuses it (it used to yield no token)
    with pytest.raises(RequestError, match="max_tokens must be at least 1") as e:
        Request(prompt, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_empty_prompt_is_a_clear_error(target):
    with pytest.raises(ValueError, match="empty prompt") as e:
        decode(Session(target), Request([], max_tokens=4))
    assert e.value.param == "prompt"


def test_num_draft_beyond_the_drafter_block_is_refused_before_any_token(target, refs):
    drafter = random_drafter(target, seed=3)            # block_size 8: at most 7 drafts
    assert drafter.max_draft == 7
    with pytest.raises(ValueError, match="num_draft 8: this drafter proposes at most 7") as e:
        decode(Session(target, drafter), Request(PROMPTS[1], max_tokens=4, num_draft=8))
    assert e.value.param == "num_draft"
    # with speculation off the drafter is never asked, so any num_draft runs
    prompt, ref = refs[1]
    out = list(decode(Session(target, drafter),
                      Request(prompt, max_tokens=LENGTH, num_draft=8, speculative="off")))
    assert out == ref


def test_prompt_beyond_the_context_limit_is_a_clear_error_and_output_stops_at_it():
    short = tiny_target(seed=1, max_position_embeddings=12)
    with pytest.raises(ValueError, match="context limit is 12"):
        decode(Session(short), Request(list(range(1, 13)), max_tokens=4))
    stats = Stats()
    out = list(decode(Session(short), Request(list(range(1, 9)), max_tokens=100,
                                              speculative="off"), stats))
    assert len(out) == 4 and stats.finish_reason == "length"   # 8 + 4 = 12 positions


def test_sampling_is_reproducible_from_a_seed_and_differs_across_seeds(target):
    drafter = random_drafter(target)
    runs = [list(decode(Session(target, drafter),
                        Request(PROMPTS[1], max_tokens=12, num_draft=3, speculative="on",
                                temperature=1.0, top_p=0.9, top_k=20, seed=s)))
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_a_session_prefills_only_the_new_part_of_an_extended_prompt(target, refs):
    prompt, ref = refs[1]
    drafter = OracleDrafter(prompt + ref, V, acceptance=0.8)
    session = Session(target, drafter)
    first = list(decode(session, Request(prompt, max_tokens=8, speculative="on")))
    follow = prompt + first + [11, 12]
    stats = Stats()
    second = list(decode(session, Request(follow, max_tokens=8, speculative="on"), stats))
    assert stats.reused_tokens == len(prompt) + len(first) - 1   # the last token was never fed
    assert second == serial_greedy(target, follow, 8)
