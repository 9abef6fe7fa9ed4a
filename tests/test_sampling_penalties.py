"""mlx-lm's sampling knobs, exact under speculation: ``repetition_penalty`` (mlx-lm's, over the
last ``repetition_context_size`` tokens, prompt included), OpenAI's ``presence_penalty`` /
``frequency_penalty`` (over the generated tokens) and ``logit_bias``, ``min_p`` (mlx-lm's),
user ``logits_processors=`` and ``sampler=``.

The oracle is NumPy in float64, written from the definitions (mlx-lm's sample_utils, OpenAI's
parameter details) over full target forwards. A penalty depends on the tokens before each
position, so the drafter's rows and every verify row must see the history up to *their*
position: speculative greedy then equals serial greedy with every drafter (random ones that
are rejected everywhere, an oracle drafter and the demo pair's trained heads that are
accepted often), seeded "reproducible" sampling is the same text in every mode, and
rejection sampling is the penalised target's distribution (chi-square, with teeth)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark as md
from mlx_dspark.decode import run as run_module
from mlx_dspark.logits.draw import Draw
from mlx_dspark.decode.batch import decode
from mlx_dspark.logits.processors import Processors
from mlx_dspark.logits.sampling import Sampler, warp
from mlx_dspark.decode.session import Session
from mlx_dspark.request import Request, RequestError
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_dflash, random_drafter, random_eagle3, random_mtp, tiny_target
from test_drafters_sampling import triples
from test_sampling_acceptance import chi2_pvalue

PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2]
LENGTH = 30
ALL = dict(repetition_penalty=1.6, repetition_context_size=6, presence_penalty=0.5,
           frequency_penalty=0.3, logit_bias={5: 1.5, 11: -2.0})
OPTIONS = {"repetition": dict(repetition_penalty=1.8, repetition_context_size=8),
           "presence-frequency": dict(presence_penalty=0.9, frequency_penalty=0.6),
           "logit-bias": dict(logit_bias={5: 3.0, 52: -4.0}),
           "all": ALL}
DRAFTERS = {"dspark": lambda t: random_drafter(t),
            "mtp": lambda t: random_mtp(t, seed=2),
            "eagle3": lambda t: random_eagle3(t, seed=3),
            "dflash": lambda t: random_dflash(t, seed=4)}


def penalised64(z, seq, prompt_len, repetition_penalty=None, repetition_context_size=20,
                presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None):
    """The row after ``seq`` from the definitions, in float64: the bias added; mlx-lm's
    repetition penalty (a logit of a token among the last ``repetition_context_size`` of the
    sequence multiplied by the penalty when negative, divided when not); OpenAI's ``mu[j] -
    c[j] * frequency - (c[j] > 0) * presence``, ``c`` the counts of the generated tokens."""
    z = np.array(z, np.float64)
    for token, b in (logit_bias or {}).items():
        z[token] += b
    if repetition_penalty is not None:
        for token in set(seq[-repetition_context_size:]):
            z[token] = z[token] * repetition_penalty if z[token] < 0 \
                else z[token] / repetition_penalty
    c = np.bincount(np.array(seq[prompt_len:], int), minlength=z.size)[:z.size]
    return z - frequency_penalty * c - presence_penalty * (c > 0)


def oracle_greedy(target, prompt, n, **options):
    seq = list(prompt)
    for _ in range(n):
        z = np.array(target(mx.array([seq]))[0, -1], np.float64)
        seq.append(int(np.argmax(penalised64(z, seq, len(prompt), **options))))
    return seq[len(prompt):]


def generate(target, drafter, mode="off", stats=None, **options):
    request = Request(PROMPT, max_tokens=LENGTH, speculative=mode, **options)
    return list(decode(Session(target, drafter), request, stats))


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def serial(target):
    return {name: generate(target, None, **o) for name, o in OPTIONS.items()}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_penalised_greedy_decoding_follows_the_numpy_definitions(target, serial, name):
    assert serial[name] == oracle_greedy(target, PROMPT, LENGTH, **OPTIONS[name])
    assert serial[name] != generate(target, None)          # the penalty changed the text


@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("n", [1, 3, 5])
def test_speculative_greedy_with_penalties_equals_serial_with_every_drafter(
        target, serial, kind, n):
    drafter = DRAFTERS[kind](target)
    for name, options in OPTIONS.items():
        stats = Stats()
        assert generate(target, drafter, "on", stats, num_draft=n, **options) == serial[name]
        assert stats.rounds > 0


@pytest.mark.parametrize("n", [2, 4, 7])
def test_accepted_drafts_give_the_next_verify_rows_their_history(target, serial, n):
    # a drafter that proposes the penalised serial text, right 85 % of the time: every verify
    # row after an accepted draft is penalised with the drafts before it
    oracle = OracleDrafter(PROMPT + serial["all"], 97, acceptance=0.85, seed=n)
    stats = Stats()
    assert generate(target, oracle, "on", stats, num_draft=n, **ALL) == serial["all"]
    assert stats.accepted >= stats.rounds


def bonus_history_only(self, logits, bonus, drafts):
    """A broken ``Row.verified``: every verify row penalised with the first row's history
    (every row's code 0: usable)."""
    p = self.processors
    return mx.concatenate([p(p.history(self.session.tokens, bonus), logits[i:i + 1])
                           for i in range(logits.shape[0])]), \
        mx.zeros((logits.shape[0],), mx.int32)


def test_verify_rows_with_the_wrong_history_are_caught(target, serial, monkeypatch):
    """The test above has teeth."""
    monkeypatch.setattr(run_module.Row, "verified", bonus_history_only)
    oracle = OracleDrafter(PROMPT + serial["all"], 97, acceptance=0.7, seed=3)
    assert generate(target, oracle, "on", num_draft=4, **ALL) != serial["all"]


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_every_drafter_draws_each_row_after_the_context_bonus_and_drafts_before_it(
        target, kind):
    session = Session(target, DRAFTERS[kind](target))
    list(decode(session, Request(PROMPT, max_tokens=4, speculative="on")))
    session.flush()
    seen = []

    def record(tokens, logits):
        seen.append(np.array(tokens).tolist())
        return logits

    history = session.tokens + [7]
    draw = Draw(Sampler(), processors=Processors([record]), history=mx.array(history))
    tokens, _ = session.drafter.propose(7, 4, draw, cache=session.draft_cache)
    drafts = tokens.tolist()
    assert seen == [history + drafts[:j] for j in range(4)]


def test_a_drafters_rows_are_penalised_before_they_are_drawn(target):
    """The logits propose returns are the rows as drawn: penalised with each row's history."""
    session = Session(target, random_drafter(target))
    list(decode(session, Request(PROMPT, max_tokens=4, speculative="on")))
    session.flush()
    history = session.tokens + [7]
    marks = session.draft_cache.snapshot()
    raw_tokens, raw = session.drafter.propose(7, 1, cache=session.draft_cache)
    session.draft_cache.restore(marks)
    options = dict(logit_bias={int(raw_tokens[0]): -50.0})
    draw = Draw(Sampler(), processors=Processors.of(Request(PROMPT, **options)),
                history=mx.array(history))
    tokens, z = session.drafter.propose(7, 1, draw, cache=session.draft_cache)
    want = penalised64(np.array(raw[0]), history, len(PROMPT), **options)
    assert np.allclose(np.array(z[0]), want, atol=1e-4)
    assert tokens.tolist() != raw_tokens.tolist()


# ---------------------------------------------------------------------------------------------
# user logits_processors= and sampler=


def no_immediate_repeat(tokens, logits):
    """An mlx-lm-style processor that writes into its row: the previous token is banned."""
    logits[:, tokens[-1:]] = -float("inf")
    return logits


def test_a_user_logits_processor_is_applied_to_every_row_with_its_history(target):
    want, seq = [], list(PROMPT)
    for _ in range(LENGTH):                       # the oracle: argmax without the last token
        z = np.array(target(mx.array([seq]))[0, -1], np.float64)
        z[seq[-1]] = -np.inf
        seq.append(int(np.argmax(z)))
    want = seq[len(PROMPT):]
    assert generate(target, None, logits_processors=[no_immediate_repeat]) == want
    oracle = OracleDrafter(PROMPT + want, 97, acceptance=0.7, seed=1)
    for drafter in (oracle, *(make(target) for make in DRAFTERS.values())):
        stats = Stats()
        assert generate(target, drafter, "on", stats, num_draft=3,
                        logits_processors=[no_immediate_repeat]) == want
        assert stats.rounds > 0


def second_choice(logprobs):
    """A user sampler (logprobs -> token): the second most likely token."""
    return mx.argsort(-logprobs, axis=-1)[:, 1]


def test_a_user_sampler_chooses_every_token_and_speculation_keeps_its_choices(target):
    seq = list(PROMPT)
    for _ in range(LENGTH):
        z = np.array(target(mx.array([seq]))[0, -1], np.float64)
        seq.append(int(np.argsort(-z, kind="stable")[1]))
    want = seq[len(PROMPT):]
    stats = Stats()
    assert generate(target, None, "off", stats, sampler=second_choice) == want
    assert stats.sampling == "sampler"
    oracle = OracleDrafter(PROMPT + want, 97, acceptance=0.8, seed=2)
    for drafter in (oracle, random_drafter(target)):
        stats = Stats()
        assert generate(target, drafter, "on", stats, num_draft=3,
                        sampler=second_choice) == want
        assert stats.rounds > 0
    greedy = generate(target, None)                  # mlx-lm's greedy sampler is greedy
    oracle = OracleDrafter(PROMPT + greedy, 97, acceptance=0.8, seed=2)
    assert generate(target, oracle, "on", num_draft=3,
                    sampler=lambda lp: mx.argmax(lp, axis=-1)) == greedy


# ---------------------------------------------------------------------------------------------
# min_p


def min_p64(z, temperature, min_p, keep=1):
    """mlx-lm's min-p in float64: keep p_i >= min_p * p_max of the untempered distribution
    (and the ``keep`` most likely), then the temperature."""
    z = np.array(z, np.float64)
    p = np.exp(z - z.max())
    kept = p >= min_p * p.max()
    kept[np.argsort(-z, kind="stable")[:keep]] = True
    w = np.where(kept, np.exp((z - z.max()) / temperature), 0.0)
    return w / w.sum()


@pytest.mark.parametrize("temperature,min_p,keep", [(1.0, 0.1, 1), (0.6, 0.3, 1),
                                                     (2.0, 0.05, 1), (1.0, 0.9, 4)])
def test_min_p_warp_is_mlx_lms_min_p(temperature, min_p, keep):
    z = np.random.default_rng(0).normal(size=(3, 50)) * 2
    got = np.array(warp(mx.array(z, mx.float32), temperature, min_p=min_p,
                        min_tokens_to_keep=keep))
    for row, want in zip(got, (min_p64(r, temperature, min_p, keep) for r in z)):
        assert np.allclose(row, want, atol=1e-6)
        assert (row > 0).sum() >= keep


@pytest.mark.parametrize("kind", list(DRAFTERS) + ["oracle"])
def test_seeded_reproducible_sampling_with_min_p_and_penalties_is_the_same_in_every_mode(
        target, kind):
    options = dict(temperature=1.0, min_p=0.05, seed=11, sampling="reproducible", **ALL)
    ref = generate(target, None, **options)
    assert ref != generate(target, None, **{**options, "min_p": 0.0})   # min_p mattered
    drafter = OracleDrafter(PROMPT + ref, 97, acceptance=0.7) if kind == "oracle" \
        else DRAFTERS[kind](target)
    for mode, n in (("on", 1), ("on", 3), ("on", 6), ("auto", 3)):
        stats = Stats()
        assert generate(target, drafter, mode, stats, num_draft=n, **options) == ref
    assert stats.sampling == "reproducible" and stats.seed == 11


# ---------------------------------------------------------------------------------------------
# rejection sampling: the penalised, min-p-filtered target in distribution

V, SHORT, DRAWS = 6, [1, 4, 2, 5, 3], 800      # V: test_drafters_sampling's, as triples takes
SAMPLED = dict(temperature=1.0, min_p=0.02, repetition_penalty=2.0,
               repetition_context_size=3, presence_penalty=2.0, frequency_penalty=1.5)


def exact_triples(small) -> np.ndarray:
    def probs(prefix):
        seq = SHORT + list(prefix)
        z = np.array(small(mx.array([seq]))[0, -1], np.float64)
        z = penalised64(z, seq, len(SHORT), **{k: v for k, v in SAMPLED.items()
                                                if k not in ("temperature", "min_p")})
        return min_p64(z, SAMPLED["temperature"], SAMPLED["min_p"])
    return triples(probs)


def first_three_pvalue(draws=DRAWS) -> float:
    small = tiny_target(seed=4, vocab_size=V)
    session = Session(small, random_drafter(small, tap_layers=(1, 3)))
    list(decode(session, Request(SHORT[:-1], max_tokens=1, speculative="off")))
    snap = session.snapshot()
    counts = np.zeros((V, V, V))
    for seed in range(draws):
        session.restore(snap)
        out = list(decode(session, Request(SHORT, max_tokens=4, seed=seed, num_draft=2,
                                           speculative="on", sampling="rejection",
                                           **SAMPLED)))
        counts[tuple(out[:3])] += 1
    expected = exact_triples(small) * draws
    small_cells = expected < 5
    return chi2_pvalue(np.append(counts[~small_cells], counts[small_cells].sum()),
                       np.append(expected[~small_cells], expected[small_cells].sum()))


@pytest.mark.slow
def test_rejection_sampling_with_penalties_and_min_p_matches_the_penalised_target():
    assert first_three_pvalue() > 1e-3


@pytest.mark.slow
def test_the_chi_square_test_fails_when_verify_rows_miss_the_drafts_before_them(monkeypatch):
    monkeypatch.setattr(run_module.Row, "verified", bonus_history_only)
    assert first_three_pvalue() < 1e-3


# ---------------------------------------------------------------------------------------------
# the demo pair's trained drafters, which are accepted often


@pytest.mark.parametrize("kind", ["dspark", "mtp", "eagle3"])
def test_penalised_greedy_on_the_demo_pair_is_serial_greedy_with_every_drafter_kind(kind):
    pair = md.load(drafter=kind, dtype=mx.float32)
    options = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                   min_p=0.1)
    serial = md.generate(pair, "def reverse(s):", max_tokens=32, speculative=False, **options)
    spec = md.generate(pair, "def reverse(s):", max_tokens=32, speculative=True, num_draft=3,
                       **options)
    assert spec.tokens == serial.tokens
    assert spec.stats["rounds"] > 0 and spec.stats["accepted"] >= spec.stats["rounds"] / 4
    plain = md.generate(pair, "def reverse(s):", max_tokens=32, speculative=False)
    assert plain.tokens != serial.tokens


# ---------------------------------------------------------------------------------------------
# the Request checks each once


@pytest.mark.parametrize("options,field", [
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p="0.1"), "min_p"),
    (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=-1.2), "repetition_penalty"),
    (dict(repetition_penalty=1e-38), "repetition_penalty"),
    (dict(repetition_penalty=1e-4), "repetition_penalty"),
    (dict(repetition_penalty=1e4), "repetition_penalty"),
    (dict(repetition_context_size=0), "repetition_context_size"),
    (dict(repetition_context_size=2.5), "repetition_context_size"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logits_processors=[1]), "logits_processors"),
    (dict(logits_processors=second_choice), "logits_processors"), (dict(sampler=3), "sampler"),
    (dict(sampler=second_choice, temperature=0.7), "temperature"),
    (dict(sampler=second_choice, seed=1), "seed"),
])
def test_a_bad_sampling_knob_is_one_error_naming_it(options, field):
    with pytest.raises(RequestError) as e:
        Request([1, 2], **options)
    assert e.value.param == field and field.split("_")[0] in str(e.value)


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_decoding(target):
    with pytest.raises(RequestError) as e:
        decode(Session(target), Request(PROMPT, logit_bias={97: 1.0}))
    assert e.value.param == "logit_bias" and "97" in str(e.value)


# ---------------------------------------------------------------------------------------------
# logits a field leaves unusable end the run naming it (never a run of token 0)


@pytest.mark.parametrize("options,field", [
    (dict(logits_processors=[lambda tokens, z: z * mx.nan]), "logits_processors"),
    (dict(logits_processors=[lambda tokens, z: mx.where(mx.arange(z.shape[-1]) == 7, mx.inf,
                                                        z)]), "logits_processors"),
    (dict(logits_processors=[lambda tokens, z: z - mx.inf]), "logits_processors"),
    (dict(logit_bias={5: 1e39}), "logit_bias"),     # finite in Python, inf in float32
    (dict(sampler=lambda lp: mx.array([97])), "sampler"),     # the tiny target has 97 ids
    (dict(sampler=lambda lp: -1), "sampler"),
    (dict(sampler=lambda lp: 2 ** 40 + 5), "sampler")])    # not wrapped to 5
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_logits_a_field_leaves_unusable_are_an_error_naming_it(target, options, field,
                                                               temperature, mode):
    if "sampler" in options:
        temperature = 0.0
    with pytest.raises(RequestError) as e:
        generate(target, random_drafter(target), mode, temperature=temperature, **options)
    assert e.value.param == field and field in str(e.value)


def test_a_processor_that_bans_tokens_with_minus_inf_is_no_error(target):
    ban = [lambda tokens, z: mx.where(mx.arange(z.shape[-1]) < 50, -mx.inf, z)]
    assert all(t >= 50 for t in generate(target, None, logits_processors=ban))
    assert generate(target, random_drafter(target), "on", logits_processors=ban) == \
        generate(target, None, logits_processors=ban)
