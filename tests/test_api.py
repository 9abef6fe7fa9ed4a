"""The public API (md.load / md.generate / md.stream_generate) on a converted NVFP4 pair made by
the real converter from the committed ModelOpt exports (tests/cli_pair.py; random weights, a
small BPE tokenizer), and greedy speculation == serial greedy on that NVFP4 target."""

import pytest

import mlx_dspark as md
from cli_pair import make_pair
from mlx_dspark.speculative import Stats, decode
from mlx_dspark.oracle_drafter import OracleDrafter

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
        ref = list(decode(pair.target, None, ids, max_tokens=24, speculative=False))
        oracle = OracleDrafter(ids + ref, vocab, 0.6, seed=n,
                               target_layer_ids=pair.drafter.target_layer_ids)
        for drafter in (pair.drafter, oracle):
            stats = Stats()
            out = list(decode(pair.target, drafter, ids, max_tokens=24, num_draft=n,
                              speculative=True, stats=stats))
            assert out == ref
            assert stats.rounds > 0


def test_a_fresh_call_starts_from_what_earlier_calls_learned(tmp_path):
    # The converted fixture drafter has random weights: the first call learns that rounds
    # don't pay; a second one-shot call must not pay the warm-up round again.
    target_dir, drafter_dir = make_pair(tmp_path)
    fresh = md.load(target_dir, drafter_dir)
    first = md.generate(fresh, PROMPTS[1], max_tokens=24)
    assert first.stats["rounds"] >= 1 and first.stats["mode"] == "serial"
    second = md.generate(fresh, PROMPTS[2], max_tokens=10)
    assert second.stats["rounds"] == 0 and second.stats["serial_steps"] == 9
