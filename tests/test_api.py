"""The public API (md.load / md.generate / md.stream_generate) on a converted NVFP4 pair made by
the real converter from the committed ModelOpt exports (tests/cli_pair.py; random weights, a
small BPE tokenizer), and greedy speculation == serial greedy on that NVFP4 target."""

import pytest

import mlx_dspark as md
from testkit.cli_pair import make_pair
from testkit.loop_helpers import FixedCosts
from mlx_dspark.request import Request, RequestError
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.stats import Stats
from testkit.oracle_drafter import OracleDrafter

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "What is the capital of France?"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_pair(tmp_path_factory.mktemp("pair"))
    return md.load(target_dir, drafter_dir)


def collect(stream, stop_tokens=()):
    """Text, output tokens (a final stop token left out, as generate() does) and the chunks."""
    chunks = list(stream)
    tokens = [c.token for c in chunks]
    if chunks and chunks[-1].finish_reason == "stop" and tokens[-1] in stop_tokens:
        tokens.pop()
    return "".join(c.text for c in chunks), tokens, chunks


def test_generate_returns_text_tokens_and_the_documented_stats(pair):
    res = md.generate(pair, PROMPTS[0], max_tokens=12, speculative=True)
    assert len(res.tokens) == 12 and res.text == pair.tokenizer.decode(res.tokens)
    s = res.stats
    for key in ("rounds", "drafted", "accepted", "acceptance_by_position",
                "mean_accepted_per_round", "mean_tokens_per_round", "mode_switches",
                "tokens_per_s", "mode", "finish_reason"):
        assert key in s
    assert set(s["time"]) == {"prefill", "serial", "draft", "verify", "rollback", "other"}
    assert s["rounds"] > 0 and s["drafted"] >= s["accepted"] and s["finish_reason"] == "length"
    assert len(s["acceptance_by_position"]) == 3


@pytest.mark.parametrize("kwargs", [
    dict(speculative=True), dict(speculative="auto"), dict(speculative=False),
    dict(speculative=True, temperature=0.9, top_p=0.9, top_k=40, seed=3),
], ids=["spec", "auto", "serial", "sampled"])
def test_streaming_yields_exactly_the_text_generate_returns(pair, kwargs):
    for prompt in PROMPTS:
        res = md.generate(pair, prompt, max_tokens=20, **kwargs)
        text, tokens, chunks = collect(md.stream_generate(pair, prompt, max_tokens=20, **kwargs),
                                       pair.tokenizer.eos_token_ids)
        assert (text, tokens) == (res.text, res.tokens)
        # mlx-lm's convention: every chunk carries a token, the last one the finish reason
        assert all(isinstance(c.token, int) for c in chunks)
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == res.finish_reason is not None


def test_a_stop_string_ends_the_text_just_before_it_streaming_or_not(pair):
    full = md.generate(pair, PROMPTS[1], max_tokens=30, speculative=False)
    i = max(3, len(full.text) // 2)
    stop = full.text[i:i + 3]                          # something the model will say
    cut = full.text.find(stop)
    for spec in (True, False):
        res = md.generate(pair, PROMPTS[1], max_tokens=30, speculative=spec, stop=[stop])
        assert res.text == full.text[:cut] and res.finish_reason == "stop"
        text, _, _ = collect(md.stream_generate(pair, PROMPTS[1], max_tokens=30,
                                                speculative=spec, stop=[stop]))
        assert text == res.text


def test_a_stop_token_is_not_part_of_the_output(pair):
    full = md.generate(pair, PROMPTS[2], max_tokens=24, speculative=False)
    k = next(i for i in range(2, 24) if full.tokens[i] not in full.tokens[:i])
    res = md.generate(pair, PROMPTS[2], max_tokens=24, speculative=True, num_draft=5,
                      stop=[full.tokens[k]])
    assert res.tokens == full.tokens[:k] and res.finish_reason == "stop"


def test_empty_and_too_long_prompts_are_clear_errors(pair):
    for empty in ("", []):
        with pytest.raises(ValueError, match="empty prompt"):
            md.generate(pair, empty)
    limit = pair.target.config.extra["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"context limit is {limit}"):
        md.generate(pair, [5] * limit)


def test_token_id_prompts_are_used_verbatim_and_chat_applies_the_template(pair):
    ids = pair.tokenizer.encode(PROMPTS[0])
    assert md.generate(pair, ids, max_tokens=8).tokens == \
        md.generate(pair, PROMPTS[0], max_tokens=8).tokens
    templated = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True)
    assert md.generate(pair, PROMPTS[2], chat=True, max_tokens=8).tokens == \
        md.generate(pair, list(templated), max_tokens=8).tokens


@pytest.mark.parametrize("n", [1, 3, 7])
def test_speculative_greedy_equals_serial_greedy_on_an_nvfp4_target(pair, n):
    # The fixture drafter is random (useless); the oracle exercises partial acceptance too.
    vocab = pair.target.config.vocab_size
    for prompt in PROMPTS:
        ids = pair.tokenizer.encode(prompt)
        ref = list(decode(Session(pair.target), Request(ids, max_tokens=24, speculative="off")))
        oracle = OracleDrafter(ids + ref, vocab, 0.6, seed=n,
                               target_layer_ids=pair.drafter.target_layer_ids)
        for drafter in (pair.drafter, oracle):
            stats = Stats()
            out = list(decode(Session(pair.target, drafter),
                              Request(ids, max_tokens=24, num_draft=n, speculative="on"), stats))
            assert out == ref
            assert stats.rounds > 0


def test_a_fresh_call_starts_from_what_earlier_calls_learned(tmp_path):
    # The converted fixture drafter has random weights: the first call learns that rounds
    # don't pay; a second one-shot call must not pay the warm-up round again. Costs are fixed
    # (a round = 2 serial steps, so 4 accepted tokens would pay) so that the machine's load
    # cannot decide instead of the drafter.
    target_dir, drafter_dir = make_pair(tmp_path)
    fresh = md.load(target_dir, drafter_dir)
    fresh.controller = FixedCosts(3, round_cost=2.0)
    first = md.generate(fresh, PROMPTS[1], max_tokens=24)
    assert first.stats["rounds"] >= 1 and first.stats["mode"] == "serial"
    assert fresh.controller.__class__ is FixedCosts       # the pair kept what it learned
    second = md.generate(fresh, PROMPTS[2], max_tokens=10)
    assert second.stats["rounds"] == 0 and second.stats["serial_steps"] == 9


def test_forced_calls_leave_what_auto_learned(tmp_path):
    # A call with speculation forced on or off in between must not wipe the pair's learned
    # controller: the next "auto" call still skips the warm-up round.
    target_dir, drafter_dir = make_pair(tmp_path)
    fresh = md.load(target_dir, drafter_dir)
    learned = fresh.controller = FixedCosts(3, round_cost=2.0)
    md.generate(fresh, PROMPTS[1], max_tokens=24)
    for forced in ("on", "off"):
        assert md.generate(fresh, PROMPTS[0], max_tokens=8, speculative=forced).tokens
    assert fresh.controller is learned
    after = md.generate(fresh, PROMPTS[2], max_tokens=10)
    assert after.stats["rounds"] == 0 and after.stats["serial_steps"] == 9


def test_token_ids_outside_the_vocabulary_are_a_clear_error_before_anything_runs(pair):
    vocab = pair.target.config.vocab_size
    for bad in (10 ** 6, vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's "
                                             fr"vocabulary \[0, {vocab}\)"):
            md.generate(pair, [1, 2, bad], max_tokens=4)


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"), (dict(top_p=float("nan")), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(sampling="greedy"), "sampling"), (dict(seed="7"), "seed"),
])
def test_sampling_nonsense_is_refused_with_one_line_naming_the_parameter(pair, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must") as e:
        md.generate(pair, PROMPTS[0], max_tokens=4, **kwargs)
    assert "\n" not in str(e.value)


def test_sampling_parameters_keep_mlx_lm_meanings(pair):
    def run(**kw):
        return md.generate(pair, PROMPTS[1], max_tokens=12, seed=4, speculative=False, **kw)

    greedy = run().tokens
    sampled = run(temperature=1.0).tokens
    assert sampled != greedy
    assert run(temperature=1.0, top_p=0.0).tokens == sampled     # top_p 0 = off, as 1
    assert run(temperature=1.0, top_p=1.0, top_k=0).tokens == sampled
    # A tiny temperature is the greedy limit, computed stably (no inf - inf, no NaN).
    assert run(temperature=1e-30).tokens == run(temperature=1e-45).tokens == greedy


@pytest.mark.parametrize("sampling", ["reproducible", "rejection"])
def test_both_sampling_schemes_are_reproducible_from_a_seed_in_one_mode(pair, sampling):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, speculative=True, sampling=sampling)
    assert md.generate(pair, PROMPTS[0], seed=3, **kw).tokens == \
        md.generate(pair, PROMPTS[0], seed=3, **kw).tokens


def test_a_seed_gives_the_same_text_in_every_mode_with_reproducible_sampling(pair):
    kw = dict(max_tokens=20, temperature=0.8, top_p=0.95, seed=12, sampling="reproducible")
    texts = {md.generate(pair, PROMPTS[0], speculative=s, num_draft=n, **kw).text
             for s, n in ((False, 3), (True, 1), (True, 5), ("auto", 3))}
    assert len(texts) == 1


def test_a_seed_is_0_to_2_to_the_64_as_the_server_takes_it(pair):
    kw = dict(max_tokens=8, temperature=1.0, speculative=False)
    assert len(md.generate(pair, PROMPTS[0], seed=2 ** 64 - 1, **kw).tokens) == 8
    for seed in (2 ** 64, -1, 1.5):
        with pytest.raises(RequestError, match=r"seed must be an integer in \[0, 2\*\*64\)") as e:
            md.generate(pair, PROMPTS[0], seed=seed, **kw)
        assert e.value.param == "seed"


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_every_chunk_carries_mlx_lms_fields_as_they_stand_at_its_token(pair, speculative):
    """mlx-lm's GenerationResponse names (read off mlx-lm itself), on every chunk and current
    there; before, only ``stats`` (peak memory on the last chunk alone)."""
    import dataclasses
    import importlib
    names = {f.name for f in dataclasses.fields(
        importlib.import_module("mlx_lm.generate").GenerationResponse)}
    wanted = {"prompt_tokens", "prompt_tps", "generation_tokens", "generation_tps",
              "peak_memory"}
    assert wanted <= names
    prompt = list(range(5, 25))
    chunks = list(md.stream_generate(pair, prompt, max_tokens=12, speculative=speculative))
    assert [c.generation_tokens for c in chunks] == list(range(1, 13))
    assert all(c.prompt_tokens == 20 and c.prompt_tps > 0 for c in chunks)
    assert all(c.generation_tps > 0 for c in chunks[4:])
    peaks = [c.peak_memory for c in chunks]
    assert peaks[0] > 0 and peaks == sorted(peaks)
    assert abs(peaks[-1] - chunks[-1].stats.peak_memory_gb) < 1e-9
