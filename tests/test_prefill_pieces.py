"""A prefill in pieces (decode/pieces.py, loop.prefill): a long prompt is fed about 512 tokens
at a time, so that it can report its progress and be stopped between two pieces, and it
computes exactly what one step over the whole prompt computes: the last logits, every cache
array (keys, values, the Mamba conv windows and SSM states) and the drafter's taps, to the bit.
Checkpoints still land where the prompt cache planned them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark import api
from mlx_dspark.decode import pieces
from mlx_dspark.decode.loop import prefill
from mlx_dspark.decode.session import Session

VOCAB_FLOOR = 5          # ids below are the demo tokenizer's specials


@pytest.fixture(scope="module")
def pair():
    return api.load()


def plain(pair) -> Session:
    """A session that cuts its prefill only where these tests say (pair.session() also stops
    before each prompt's last token to keep that state: tests/test_session_reuse.py)."""
    return Session(pair.target, pair.drafter)


def prompt_of(pair, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(VOCAB_FLOOR, pair.target.config.vocab_size, n).tolist()


def one_step(pair, prompt: list[int], cuts=()):
    """The reference: one target step over each stretch between the checkpoints (one step over
    the whole prompt without them), as the prefill was fed before pieces."""
    cache, start, taps = pair.target.make_cache(), 0, []
    for end in [*cuts, len(prompt)]:
        logits, t = pair.target.step(mx.array([prompt[start:end]]), cache,
                                     tap_layers=tuple(pair.drafter.target_layer_ids),
                                     last_only=True)
        taps.append(t)
        start = end
    return logits[0, -1], cache, mx.concatenate(taps)


def assert_same_state(pair, session, logits, ref):
    ref_logits, ref_cache, ref_taps = ref
    assert np.array_equal(np.array(logits), np.array(ref_logits))
    got, want = session.cache.arrays(), ref_cache.arrays()
    # every layer's state: attention keys and values, Mamba conv window and SSM state
    assert len(got) == len(want) == 2 * sum(k in "M*" for k in
                                            pair.target.config.hybrid_override_pattern)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    # the taps the drafter will take: the queued rows are the last ones of the reference's
    queued = np.array(mx.concatenate(session.pending))
    assert session.pending_start + len(queued) == len(session.tokens)
    assert np.array_equal(queued, np.array(ref_taps)[session.pending_start:])


@pytest.mark.parametrize("n", [
    1029,       # a last piece of 5: one step runs it in the chunked scan, so pieces do too
    1100,       # a last piece of 76
    2053,       # one step cuts at 2048 and runs the last 5 serially: so do the pieces
])
def test_pieces_compute_what_one_step_computes_to_the_bit(pair, n):
    prompt = prompt_of(pair, n)
    seen = []
    session = plain(pair)
    logits = prefill(session, prompt, tap=True, progress=lambda *a: seen.append(a))
    assert [a[:2] for a in seen] == [(0, n)] + [(e, n) for e in pieces.ends(0, [n], pair.target)]
    assert len(seen) >= n // pieces.PIECE + 1       # reported after each piece, not at the end
    assert all(b[2] >= a[2] for a, b in zip(seen, seen[1:]))      # seconds since the start
    assert_same_state(pair, session, logits, one_step(pair, prompt))


def test_checkpoints_land_where_they_did_and_the_stretches_compute_as_before(pair):
    prompt, cuts = prompt_of(pair, 1500, seed=1), (300, 1000)
    session, taken = plain(pair), []
    session.checkpoints, session.on_checkpoint = cuts, lambda s: taken.append(len(s.tokens))
    logits = prefill(session, prompt, tap=True)
    assert taken == list(cuts)
    assert_same_state(pair, session, logits, one_step(pair, prompt, cuts))


class Stop(Exception):
    pass


def test_a_callback_that_raises_stops_between_two_pieces_and_the_rest_continues_exactly(pair):
    prompt = prompt_of(pair, 1400, seed=2)

    def stop_after_two(done, total, seconds):
        if done >= 2 * pieces.PIECE:
            raise Stop

    session = plain(pair)
    with pytest.raises(Stop):
        prefill(session, prompt, tap=True, progress=stop_after_two)
    assert len(session.tokens) == 2 * pieces.PIECE       # whole pieces, nothing half-fed
    assert session.cache.offset == 2 * pieces.PIECE
    logits = prefill(session, prompt, tap=True)          # a retry continues from there
    assert_same_state(pair, session, logits, one_step(pair, prompt))


def test_stream_generate_and_generate_report_the_prefill_and_give_the_same_tokens(pair):
    prompt = prompt_of(pair, 1200, seed=3)
    calls = []
    streamed = list(api.stream_generate(pair, prompt, 4, speculative="off",
                                        progress=lambda *a: calls.append(a)))
    assert [c[:2] for c in calls] == [(0, 1200), (512, 1200), (1024, 1200), (1200, 1200)]
    whole = api.generate(pair, prompt, 4, speculative="off")
    assert [c.token for c in streamed] == whole.tokens
    seen = []
    api.generate(pair, prompt, 2, speculative="off", progress=lambda *a: seen.append(a))
    assert [c[:2] for c in seen] == [c[:2] for c in calls]


def test_smaller_pieces_later_in_a_long_prompt_compute_what_one_step_computes(pair):
    """The sizes shrink with the context (512, 256, 128 tokens); the schedule is moved earlier
    here so that a short prompt crosses both changes, the second past one step's 2048 cut."""
    sizes = ((0, 512), (1024, 256), (1792, 128))
    prompt = prompt_of(pair, 2600, seed=4)
    ends = pieces.ends(0, [len(prompt)], pair.target, sizes)
    assert ends[:4] == [512, 1024, 1280, 1536] and ends[-3:] == [2432, 2560, 2600]
    session, start = plain(pair), 0
    for end in ends:            # prefill's own loop, with this schedule
        logits, taps = pair.target.step(mx.array([prompt[start:end]]), session.cache,
                                        tap_layers=session.tap_layers, last_only=True)
        session.feed(prompt[start:end], taps)
        start = end
    assert_same_state(pair, session, logits[0, -1], one_step(pair, prompt))


def test_the_cuts_are_every_piece_between_the_stops():
    class Target:               # the demo target's rules: steps cut at 2048, serial up to 8
        prefill_step, serial_max = 2048, 8
    ends = pieces.ends
    assert ends(0, [1200], Target) == [512, 1024, 1200]
    assert ends(0, [1029], Target) == [512, 1029]            # no tail of 5 after 1024
    assert ends(0, [2053], Target) == [512, 1024, 1536, 2048, 2053]    # one step's own cut
    assert ends(100, [400, 1500], Target) == [400, 912, 1424, 1500]    # from each stop
    assert ends(0, [600], object()) == [512, 600]           # a target without the rules
    assert ends(7, [7 + 300], Target) == [307]
    # from 4096 tokens of context pieces of 256, from 8192 of 128
    assert ends(3584, [4700], Target) == [4096, 4352, 4608, 4700]
    assert ends(8000, [8600], Target) == [8256, 8384, 8512, 8600]


def test_mlx_lms_prompt_progress_callback_names_progress(pair):
    with pytest.raises(TypeError, match=r"prompt_progress_callback.*progress=, called with "
                                        r"\(done, total, seconds\)"):
        api.generate(pair, "def f", 2, prompt_progress_callback=print)
