"""Sessions own every cache, requests own every option (issue 21).

Any number of sessions live on one pair: interleaved turn by turn, each gives exactly the
tokens it gives alone, in every mode, greedy and seeded. A request is one value checked once,
whose refusals name the parameter (and, on the command line, the flag)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import api
from mlx_dspark.cli.chat import Conversation
from mlx_dspark.cli.common import flag_error
from mlx_dspark.request import Request, RequestError
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode

PROMPTS = ["def f(x):", "class Stack:\n    def __init__(self):", "import os\n\n"]
FOLLOW = [[10, 11], [4, 101, 9], [17]]            # each turn extends its own session
SETTINGS = [
    dict(speculative=mode) for mode in ("auto", "on", "off")
] + [
    dict(speculative=mode, temperature=1.0, top_p=0.95, seed=7, sampling="reproducible")
    for mode in ("auto", "on", "off")
] + [
    # rejection sampling reproduces a seed only in a fixed mode ("auto" follows timings)
    dict(speculative=mode, temperature=0.8, seed=3, sampling="rejection") for mode in ("on", "off")
]


@pytest.fixture(scope="module")
def pair():
    return md.load()


def _turns(pair, session, k, options):
    """Turn ``k`` of conversation ``session``: its prompt is what the session holds plus new
    ids (or the opening prompt)."""
    prompt = PROMPTS[session.which] if k == 0 else list(session.tokens) + FOLLOW[k - 1]
    return md.generate(pair, prompt, max_tokens=10, session=session, **options).tokens


@pytest.mark.parametrize("options", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_interleaved_sessions_give_the_tokens_of_lone_sessions(pair, options):
    alone = []
    for which in range(3):
        session = pair.session()
        session.which = which
        alone.append([_turns(pair, session, k, options) for k in range(3)])
    sessions = [pair.session() for _ in range(3)]
    for which, session in enumerate(sessions):
        session.which = which
    together = [[] for _ in sessions]
    for k in range(3):
        for which, session in enumerate(sessions):
            together[which].append(_turns(pair, session, k, options))
            # an implicit session in between (a one-off generate) must not disturb them
            md.generate(pair, "x = 1", max_tokens=3, **options)
    assert together == alone


def test_interleaved_chats_give_the_answers_of_lone_chats(pair):
    users = [["Write a function.", "Now test it."], ["Hello!", "Tell me more."]]

    def chat(conversation, session, user):
        ids = conversation.prompt(user)
        res = md.generate(pair, ids, max_tokens=12, session=session, speculative="on")
        conversation.add_turn(user, ids, res.tokens, res.text)
        return res.tokens, res.stats.reused_tokens

    def new():
        return Conversation(pair.tokenizer, {}), pair.session()

    alone = []
    for lines in users:
        conversation, session = new()
        alone.append([chat(conversation, session, u) for u in lines])
    chats = [new() for _ in users]
    together = [[] for _ in users]
    for turn in range(2):
        for i, (conversation, session) in enumerate(chats):
            together[i].append(chat(conversation, session, users[i][turn]))
    assert together == alone
    assert all(t[1][1] > 0 for t in together)      # the second turn reused the first


def test_the_issues_two_calls_now_behave(pair):
    # 1. A session made with a mode (the old spelling) does not override the call's mode.
    with pytest.warns(DeprecationWarning, match="no longer takes a mode"):
        old = pair.session("off")
    res = md.generate(pair, "def f(x):", max_tokens=12, speculative="on", session=old)
    assert res.stats.requested == "on" and res.stats.rounds > 0
    # 2. A second session no longer breaks the first.
    s = pair.session()
    md.generate(pair, "def f(x):", 8, speculative="on", session=s)
    md.generate(pair, "class A:", 8, speculative="on")
    again = md.generate(pair, list(s.tokens) + [10, 11], 8, speculative="on", session=s)
    lone = pair.session()
    md.generate(pair, "def f(x):", 8, speculative="on", session=lone)
    assert again.tokens == md.generate(pair, list(lone.tokens) + [10, 11], 8,
                                       speculative="on", session=lone).tokens


def test_models_keep_no_context_between_sessions(pair):
    a, b = pair.session(), pair.session()
    md.generate(pair, PROMPTS[0], max_tokens=6, speculative="on", session=a)
    held = a.draft_cache.length
    md.generate(pair, PROMPTS[1] * 3, max_tokens=6, speculative="on", session=b)
    assert a.draft_cache.length == held and b.draft_cache is not a.draft_cache
    # the drafter's context plus the taps still queued cover exactly the session's tokens
    assert held + sum(t.shape[0] for t in a.pending) == len(a.tokens)


def test_a_snapshot_restores_both_caches_exactly(pair):
    s = pair.session()
    md.generate(pair, PROMPTS[2], max_tokens=5, speculative="on", session=s)
    snap = s.snapshot()
    follow = list(s.tokens) + [10, 11]
    first = md.generate(pair, follow, max_tokens=10, speculative="on", session=s).tokens
    s.restore(snap)
    assert md.generate(pair, follow, max_tokens=10, speculative="on", session=s).tokens == first


def _snapshot_of(pair, prompt):
    session = pair.session()
    md.generate(pair, prompt, max_tokens=5, speculative="on", session=session)
    return session.snapshot()


@pytest.mark.parametrize("other,reason", [
    (dict(drafter="mtp"), "taken with the MTP drafter and this session runs with the "
                          "DSpark drafter"),
    (dict(drafter="eagle3"), "taken with the EAGLE-3 drafter"),
    (dict(dtype="bfloat16"), "computed in bfloat16 and this session computes in float32"),
], ids=["mtp", "eagle3", "bfloat16"])
def test_restore_refuses_another_pairs_snapshot_first_and_the_session_goes_on(
        pair, other, reason):
    """Issue 35: an MTP or EAGLE-3 pair's snapshot raised only after it had replaced the
    target cache, and a bfloat16 pair's was taken into a float32 session."""
    snap = _snapshot_of(md.load(**other), PROMPTS[0])
    session, twin = pair.session(), pair.session()
    for s in (session, twin):
        md.generate(pair, PROMPTS[1], max_tokens=5, speculative="on", session=s)
    held = list(session.tokens)
    with pytest.raises(ValueError, match=reason):
        session.restore(snap)
    assert session.tokens == held
    follow = held + [10, 11]
    assert md.generate(pair, follow, max_tokens=10, speculative="on", session=session).tokens \
        == md.generate(pair, follow, max_tokens=10, speculative="on", session=twin).tokens


def test_restore_refuses_a_snapshot_whose_state_does_not_fit_the_target(pair):
    snap = _snapshot_of(pair, PROMPTS[2])
    offset, layers = snap.cache
    session = pair.session()
    md.generate(pair, PROMPTS[1], max_tokens=5, session=session)
    held = list(session.tokens)
    keys, values = layers[3]
    for bad, reason in [
            (dict(cache=(offset, layers[:-1])), "it has 5 target layers"),
            (dict(cache=(offset, layers[:3] + (None,) + layers[4:])), "keys and values are "
                                                                      "missing"),
            (dict(cache=(offset, layers[:3] + ((keys.astype(mx.bfloat16), values),)
                         + layers[4:])), "keys is mlx.core.bfloat16"),
            (dict(tokens=snap.tokens[:-1]), f"holds {offset} positions for {offset - 1} "
                                            f"tokens")]:
        with pytest.raises(ValueError, match=reason):
            session.restore(dataclasses.replace(snap, **bad))
        assert session.tokens == held


def test_a_snapshot_of_another_model_object_without_receipts_is_refused(pair):
    """Without receipts a session knows its models by identity (the same weights loaded
    twice are two models to it)."""
    again = md.load()
    bare = [dataclasses.replace(p, receipts=(None, None)) for p in (pair, again)]
    snap = _snapshot_of(bare[1], PROMPTS[0])
    with pytest.raises(ValueError, match="another target .no receipt"):
        bare[0].session().restore(snap)
    bare[1].session().restore(snap)          # its own pair takes it


def test_pickling_a_pair_says_what_to_do_instead(pair):
    with pytest.raises(TypeError, match=r"cannot be pickled.*Load the pair in the other "
                                        r"process.*prompt_cache_dir"):
        pickle.dumps(pair)


def test_a_call_cannot_contradict_its_session(pair):
    serial_only = Session(pair.target)                 # no drafter
    with pytest.raises(RequestError, match="speculative 'on' needs a drafter") as e:
        md.generate(pair, PROMPTS[0], max_tokens=4, speculative="on", session=serial_only)
    assert e.value.param == "speculative"
    res = md.generate(pair, PROMPTS[0], max_tokens=4, speculative="off", session=serial_only)
    assert res.stats.rounds == 0 and len(res.tokens) == 4


@pytest.mark.parametrize("field,value,flag", [
    ("temperature", -1.0, "--temp"), ("top_p", 1.5, "--top-p"), ("top_k", -2, "--top-k"),
    ("max_tokens", 0, "--max-tokens"), ("max_tokens", 2.5, "--max-tokens"),
    ("num_draft", 0, "--num-draft"), ("num_draft", 10 ** 8, "--num-draft"),
    ("num_draft", 2.5, "--num-draft"),
    ("sampling", "greedy", "--sampling"), ("speculative", "maybe", "--speculative"),
    ("seed", 2.5, "--seed"), ("thinking_token_budget", -1, "--thinking-token-budget"),
])
def test_a_refused_request_names_the_parameter_and_the_cli_names_the_flag(field, value, flag):
    with pytest.raises(RequestError) as e:
        Request([1, 2, 3], **{field: value})
    assert e.value.param == field and str(e.value).startswith(field)
    assert str(flag_error(e.value)).startswith(flag)


def test_a_request_is_mlx_free_and_takes_every_spelling_of_the_mode():
    assert Request([1], speculative=True).speculative == "on"
    assert Request([1], speculative=False).speculative == "off"
    assert Request([1], speculative="auto").speculative == "auto"
    with pytest.raises(RequestError, match="empty prompt"):
        Request([])


def test_num_draft_beyond_the_drafter_is_refused_before_any_token(pair):
    most = pair.drafter.max_draft
    with pytest.raises(RequestError, match=f"at most {most}") as e:
        decode(pair.session(), Request([5, 6], num_draft=most + 1, speculative="on"))
    assert e.value.param == "num_draft"


def test_chunks_say_which_token_is_a_stop_token_and_carry_typed_stats(pair):
    eos = sorted(pair.tokenizer.eos_token_ids)[0]
    chunks = list(md.stream_generate(pair, PROMPTS[0], max_tokens=20, stop=[eos, 4]))
    last = chunks[-1]
    assert all(not c.stop for c in chunks[:-1])
    assert last.stop == (last.finish_reason == "stop")
    assert all(c.stats.peak_memory_gb is None for c in chunks[:-1])
    assert last.stats.peak_memory_gb > 0
    # snapshots: an early chunk's stats do not move on with the run
    assert [c.stats.generated for c in chunks] == list(range(1, len(chunks) + 1))
    res = md.generate(pair, PROMPTS[0], max_tokens=20, stop=[eos, 4])
    assert res.tokens == [c.token for c in chunks if not c.stop]
    assert res.stats["generated_tokens"] == res.stats.generated        # the old dict keys


def test_a_request_object_is_taken_whole(pair):
    req = Request(api.make_request(pair, PROMPTS[0]).prompt, max_tokens=6)
    assert md.generate(pair, req).tokens == md.generate(pair, PROMPTS[0], max_tokens=6).tokens
    with pytest.raises(TypeError, match="carries every option"):
        md.generate(pair, req, temperature=0.5)


def test_no_warning_for_the_new_spelling(pair):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair.session()


def test_a_long_serial_stretch_queues_a_window_of_taps_and_the_context_is_the_same():
    from testkit.toy import random_drafter, tiny_target

    target = tiny_target(seed=1)
    drafter = random_drafter(target, window=16)          # keeps 15 context rows
    request = Request(list(range(3, 9)), max_tokens=90, speculative="off")
    capped, whole = Session(target, drafter), Session(target, drafter)
    whole.PENDING_WINDOWS = 10 ** 9                      # queue everything, as before
    assert list(decode(capped, request)) == list(decode(whole, request))
    assert capped.pending_rows <= 2 * drafter.context_keep < whole.pending_rows
    assert capped.pending_rows == sum(t.shape[0] for t in capped.pending)
    capped.flush(), whole.flush()
    assert capped.draft_cache.length == whole.draft_cache.length == len(capped.tokens)
    for x, y in zip(capped.draft_cache.arrays(), whole.draft_cache.arrays()):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
    # and a speculative continuation drafts from it exactly alike
    more = Request(list(capped.tokens) + [5], max_tokens=12, speculative="on")
    assert list(decode(capped, more)) == list(decode(whole, more))
