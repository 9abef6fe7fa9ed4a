"""Batch invariance (docs/batching.md): rows decoded together (decode/batch.py over
``NemotronH.step_rows``) give, row by row, what each request gets alone.

On MLX's stock CPU BLAS (what the tests run on) the batched forward is bitwise each row's forward
alone, so the tokens are the same, not merely close: greedy at batch 1..4 with speculation off,
on and auto with the demo pair's DSpark, MTP and EAGLE-3 drafters; seeded sampling (both
schemes); a grammar, stop tokens and lengths that differ per row; a row leaving or joining
mid-batch. With OpenBLAS preloaded the batched logits differ in the last bits (measured in
docs/batching.md): there the forward is held to that measured bound (1e-4, the same argmax)
and the tokens still to equality."""

import gc
import random

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.api import make_request
from mlx_dspark.decode.batch import Batch, decode_batch
from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.run import StaleGenerator
from mlx_dspark.decode.session import Session
from mlx_dspark.stats import Stats

def _openblas() -> bool:
    """Whether OpenBLAS serves this process's BLAS calls (preloaded in place of MLX's own;
    numpy's private copy, libscipy_openblas, serves numpy alone)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("openblas" in line and "scipy_openblas" not in line
                       for line in maps.read().lower().splitlines())
    except OSError:
        return False


OPENBLAS = _openblas()
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):\n    with open(path) as f:",
           "class Stack:\n    def __init__(self):", "x"]


@pytest.fixture(scope="module", params=["dspark", "mtp", "eagle3", "dflash"])
def pair(request):
    return md.load() if request.param == "dspark" else md.load(drafter=request.param)


def alone(pair, requests):
    return [list(decode(Session(pair.target, pair.drafter), r)) for r in requests]


def together(pair, requests, stats=None):
    return decode_batch([Session(pair.target, pair.drafter) for _ in requests], requests, stats)


@pytest.mark.parametrize("speculative", ["off", "on", "auto"])
def test_greedy_rows_at_batch_1_to_4_equal_each_request_alone(pair, speculative):
    requests = [make_request(pair, p, max_tokens=m, speculative=speculative, num_draft=3)
                for p, m in zip(PROMPTS, (24, 17, 24, 9))]
    want = alone(pair, requests)
    for b in range(1, 5):
        stats = [Stats() for _ in range(b)]
        assert together(pair, requests[:b], stats) == want[:b], f"batch {b}"
    if speculative == "on":       # the rows did speculate, and rejected drafts were rolled back
        assert all(s.rounds > 0 for s in stats) and sum(s.accepted for s in stats) < \
            sum(s.drafted for s in stats)


def test_each_rows_penalties_are_its_own(pair):
    requests = [make_request(pair, PROMPTS[0], max_tokens=20, speculative="on",
                             repetition_penalty=1.5),
                make_request(pair, PROMPTS[0], max_tokens=20, speculative="on"),
                make_request(pair, PROMPTS[1], max_tokens=20, speculative="off",
                             presence_penalty=1.0)]
    want = alone(pair, requests)
    assert want[0] != want[1]                        # the penalty changed that row's text
    assert together(pair, requests) == want


def test_seeded_sampling_reproduces_per_row(pair):
    requests = [make_request(pair, p, max_tokens=20, temperature=0.8, top_p=0.95, seed=s,
                                speculative=spec, sampling=scheme)
                for p, s, spec, scheme in zip(PROMPTS, (1, 2, 3, 1), ("on", "off", "on", "on"),
                                              ("reproducible", "reproducible", "rejection",
                                               "reproducible"))]
    want = alone(pair, requests)
    assert together(pair, requests) == want
    other = make_request(pair, PROMPTS[0], max_tokens=20, temperature=0.8, top_p=0.95,
                            seed=5, speculative="on")
    assert alone(pair, [other])[0] != want[0]         # the seed matters: the rows did sample


def test_each_row_keeps_its_own_grammar_stop_tokens_and_length(pair):
    vocab = pair.target.config.vocab_size
    free = make_request(pair, PROMPTS[0], max_tokens=30, speculative="on")
    stop_at = alone(pair, [free])[0][6]
    requests = [make_request(pair, "Give me a JSON object with a key x.", chat=True,
                                max_tokens=24, response_format={"type": "json_object"},
                                speculative="on"),
                make_request(pair, PROMPTS[0], max_tokens=30, speculative="on",
                                stop=[stop_at]),
                make_request(pair, PROMPTS[2], max_tokens=5, speculative="off"),
                free]
    want = alone(pair, requests)
    assert want[1][-1] == stop_at and len(want[1]) <= 7 and len(want[2]) == 5
    assert pair.tokenizer.decode(want[0]).startswith("{") and all(t < vocab for t in want[0])
    assert together(pair, requests) == want


@pytest.mark.parametrize("speculative", ["on", "off"])
def test_a_row_leaving_or_joining_mid_batch_leaves_the_others_tokens_unchanged(pair,
                                                                                 speculative):
    # row 0 steps with row 1, alone once row 1 leaves ("off": as the loop does, its next step
    # built ahead), then with rows 2 and 3 as they join
    requests = [make_request(pair, p, max_tokens=24, speculative=speculative) for p in PROMPTS]
    want = alone(pair, requests)
    batch = Batch()
    rows = [batch.add(Session(pair.target, pair.drafter), r) for r in requests[:2]]
    got = {id(r): list(r.tokens) for r in rows}
    for step in range(60):
        if step == 2:
            batch.remove(rows[1])              # a client leaves
        if step in (5, 7):                      # others join
            rows.append(batch.add(Session(pair.target, pair.drafter), requests[len(rows)]))
            got[id(rows[-1])] = list(rows[-1].tokens)
        for row in batch.step():
            got[id(row)] += row.tokens
        if not batch.rows:
            break
    assert [got[id(rows[i])] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    left = got[id(rows[1])]
    assert 0 < len(left) < len(want[1]) and left == want[1][:len(left)]


@pytest.mark.parametrize("block", [1, 4])
def test_the_batched_forward_is_bitwise_each_rows_forward_alone(block):
    # teacher-forced: rows at different lengths, each verify cut back by its own count
    target = md.load(drafter="none").target
    prompts = [[5] * 3, list(range(7, 40)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 7, [3]]
    rng = random.Random(0)
    for b in range(2, 5):
        mine, ours = [target.make_cache() for _ in range(b)], [target.make_cache() for _ in
                                                               range(b)]
        for p, c, d in zip(prompts, mine, ours):
            target.step(mx.array([p]), c)
            target.step(mx.array([p]), d)
        tokens = mx.array([[p[-1]] * block for p in prompts[:b]])
        for _ in range(6):
            rows = [(target.verify if block > 1 else target.step)(tokens[i:i + 1], c)[0][0]
                    for i, c in enumerate(mine)]
            batched = target.step_rows(tokens, ours, verify=block > 1)[0]
            for i, row in enumerate(rows):
                if OPENBLAS:     # its sgemm's sum order follows the row count (docs/batching.md)
                    assert mx.abs(row - batched[i]).max().item() <= 1e-4, (b, i)
                    assert mx.array_equal(row.argmax(-1), batched[i].argmax(-1)).item()
                else:
                    assert mx.array_equal(row, batched[i]).item(), (b, i)
            if block > 1:
                for i in range(b):
                    keep = rng.randint(1, block)
                    target.commit(mine[i], keep)
                    target.commit(ours[i], keep)
            tokens = mx.stack([r.argmax(-1)[-block:] for r in rows])


def test_a_batch_refuses_rows_it_cannot_decode_as_they_would_alone():
    pair, other = md.load(), md.load(drafter="none")
    batch = Batch()
    session = Session(pair.target, pair.drafter)
    batch.add(session, make_request(pair, PROMPTS[0], max_tokens=8))
    with pytest.raises(ValueError, match="already decodes"):
        batch.add(session, make_request(pair, PROMPTS[1], max_tokens=8))
    with pytest.raises(ValueError, match="one target"):
        batch.add(Session(other.target), make_request(other, PROMPTS[1], max_tokens=8))


THINK = [{"role": "user", "content": "Sort a list of numbers in Python."}]


@pytest.mark.parametrize("speculative", ["off", "on", "auto"])
def test_rows_with_thinking_budgets_decode_beside_plain_rows_as_alone(pair, speculative):
    # budgets that close the block mid-batch (0: before the first token; 1, 3), one whose
    # closing ids end the reply, one that never binds: tokens, stats and logprobs as alone
    think = {"enable_thinking": True}
    requests = [make_request(pair, THINK, 30, thinking_token_budget=b, chat_template_kwargs=think,
                             speculative=speculative, logprobs=2, **kw)
                for b, kw in [(3, {}), (0, {}), (1, {"temperature": 0.7, "seed": 5}), (300, {})]]
    requests += [make_request(pair, PROMPTS[0], 24, speculative=speculative, logprobs=2),
                 make_request(pair, THINK, 2, thinking_token_budget=1, chat_template_kwargs=think,
                              logprobs=1)]
    want = [Stats() for _ in requests]
    for stats, r in zip(want, requests):
        list(decode(Session(pair.target, pair.drafter), r, stats))
    got = [Stats() for _ in requests]
    assert together(pair, requests, got) == [
        [t for t, _, _ in s.logprobs] for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    assert [(s.finish_reason, s.generated, s.generations, s.prompt_tokens) for s in got] == \
        [(s.finish_reason, s.generated, s.generations, s.prompt_tokens) for s in want]
    assert want[0].logprobs[3][0] == requests[0].thinking.end[0]   # closed at its budget


def _held(snapshot_of) -> int:
    """Bytes of device memory that the snapshot ``snapshot_of()`` takes keeps alive."""
    gc.collect()
    before = mx.get_active_memory()
    snap = snapshot_of()
    gc.collect()
    held = mx.get_active_memory() - before
    del snap
    return held


def test_a_rows_snapshot_after_a_batch_holds_its_own_state_alone():
    # a prompt cache keeps snapshots within a byte budget: a row's Mamba states must not be
    # views that keep the whole batch's states alive
    pair = md.load()
    requests = [make_request(pair, p, max_tokens=8, speculative="off") for p in PROMPTS]

    def batched():
        sessions = [Session(pair.target, pair.drafter) for _ in requests]
        decode_batch(sessions, requests)
        return sessions[0].snapshot()

    def single():
        session = Session(pair.target, pair.drafter)
        list(decode(session, requests[0]))
        return session.snapshot()

    batched(), single()                           # compiled kernels and buffers, once
    assert _held(batched) <= _held(single) * 1.1


def test_each_rows_logprobs_are_its_own_as_alone(pair):
    requests = [make_request(pair, p, max_tokens=12, speculative=s, logprobs=2)
                for p, s in zip(PROMPTS[:3], ("on", "off", "on"))]
    want = [Stats() for _ in requests]
    for session_stats, r in zip(want, requests):
        list(decode(Session(pair.target, pair.drafter), r, session_stats))
    got = [Stats() for _ in requests]
    together(pair, requests, got)
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    assert all(len(s.logprobs) == 12 for s in got)


def test_a_row_whose_session_another_call_takes_ends_stale_and_the_others_go_on():
    pair = md.load()
    requests = [make_request(pair, p, max_tokens=16, speculative="on") for p in PROMPTS[:2]]
    want = alone(pair, requests)
    sessions = [Session(pair.target, pair.drafter) for _ in requests]
    batch = Batch()
    rows = [batch.add(s, r) for s, r in zip(sessions, requests)]
    got = [list(r.tokens) for r in rows]
    for _ in range(2):
        for row, mine in zip(batch.step(), got):
            mine += row.tokens
    other = make_request(pair, PROMPTS[2], max_tokens=6, speculative="off")
    taken = list(decode(sessions[0], other))       # another call takes row 0's session
    while batch.rows:
        for row in batch.step():
            got[rows.index(row)] += row.tokens
    assert isinstance(rows[0].error, StaleGenerator)
    assert got[1] == want[1] and got[0] == want[0][:len(got[0])] and len(got[0]) < 16
    # the stale row stepped no more on the session: it holds the other call's sequence
    assert sessions[0].tokens == list(other.prompt) + taken[:-1]


def _cache(session: Session) -> list:
    """A session's target cache as plain values, to compare bitwise: its offset, and each
    layer's keys and values (to its offset) or conv window and SSM state."""
    out = [session.cache.offset]
    for c in session.cache.layers:
        arrays = () if c is None else c.state() if hasattr(c, "state") and c.keys is not None \
            else (c.conv, c.ssm) if hasattr(c, "ssm") else ()
        out.append([None if x is None else x.tolist() for x in arrays])
    return out


def _alone_sessions(pair, requests):
    sessions = [Session(pair.target, pair.drafter) for _ in requests]
    return [list(decode(s, r)) for s, r in zip(sessions, requests)], sessions


@pytest.mark.skipif(OPENBLAS, reason="the batched forward is bitwise alone's on stock BLAS")
@pytest.mark.parametrize("at_the_end", [False, True])
def test_pipelined_rows_that_stop_or_reach_max_tokens_leave_every_cache_as_alone(monkeypatch,
                                                                                at_the_end):
    # serial rows build each batched step ahead; a stop token read mid-pipeline (the others
    # step on without the row) or at the batch's last step, and the rows reaching max_tokens,
    # leave each row's caches as alone's: the parts built ahead undone
    pair = md.load()
    free = make_request(pair, PROMPTS[0], max_tokens=24, speculative="off")
    stop_at = alone(pair, [free])[0][6]
    stopper = make_request(pair, PROMPTS[0], max_tokens=24, speculative="off", stop=[stop_at])
    requests = [stopper, make_request(pair, PROMPTS[1], max_tokens=5 if at_the_end else 9,
                                      speculative="off")]
    requests += [stopper] if at_the_end else [
        make_request(pair, PROMPTS[2], max_tokens=24, speculative="off"), free]
    want, alone_sessions = _alone_sessions(pair, requests)
    assert want[0][-1] == stop_at and len(want[0]) == 7
    rewinds = []
    rewind = type(alone_sessions[0].cache).rewind
    monkeypatch.setattr(type(alone_sessions[0].cache), "rewind",
                        lambda cache, mark: rewinds.append(mark) or rewind(cache, mark))
    sessions = [Session(pair.target, pair.drafter) for _ in requests]
    batch = Batch()
    rows = [batch.add(s, r) for s, r in zip(sessions, requests)]
    got = [list(r.tokens) for r in rows]
    pipelined = 0
    while batch.rows:
        for row in batch.step():
            got[rows.index(row)] += row.tokens
        pipelined += len(batch.rows) > 1 and all(r.session.ahead is not None
                                                  for r in batch.rows)
    assert got == want
    assert pipelined >= 4 and len(rewinds) >= 2     # the stop rows' parts and the others'
    assert all(s.ahead is None for s in sessions)
    assert [_cache(s) for s in sessions] == [_cache(s) for s in alone_sessions]


@pytest.mark.skipif(OPENBLAS, reason="the batched forward is bitwise alone's on stock BLAS")
def test_rows_joining_or_leaving_between_pipelined_steps_leave_every_cache_as_alone():
    pair = md.load()
    requests = [make_request(pair, p, max_tokens=24, speculative="off") for p in PROMPTS]
    want, alone_sessions = _alone_sessions(pair, requests)
    sessions = [Session(pair.target, pair.drafter) for _ in requests]
    batch = Batch()
    rows = [batch.add(s, r) for s, r in zip(sessions[:2], requests[:2])]
    got = [list(r.tokens) for r in rows]
    for step in range(60):
        if step == 3:
            assert sessions[1].ahead is not None        # its part of the step built ahead
            batch.remove(rows[1])                       # a client leaves
            assert sessions[0].ahead is None            # the other's part undone with it
        if step in (6, 8):                              # others join
            rows.append(batch.add(sessions[len(rows)], requests[len(rows)]))
            got.append(list(rows[-1].tokens))
        for row in batch.step():
            got[rows.index(row)] += row.tokens
        if not batch.rows:
            break
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert [_cache(sessions[i]) for i in (0, 2, 3)] == \
        [_cache(alone_sessions[i]) for i in (0, 2, 3)]
    # the row that left holds what it fed, as alone when its request ends there
    left = got[1]
    cut, cut_session = _alone_sessions(pair, [make_request(pair, PROMPTS[1], max_tokens=len(left),
                                                           speculative="off")])
    assert left == cut[0] and _cache(sessions[1]) == _cache(cut_session[0])
