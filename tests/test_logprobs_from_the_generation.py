"""Log-probabilities are read off the rows the generation computed (Request.logprobs): the
same numbers as scoring the reply again with the target, in serial and speculative decoding,
without a second pass over the prompt and reply, a thinking budget's closing ids and a reply a
stop string ends included."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark.serve import logprobs
from mlx_dspark.stats import Stats

PROMPT = "def parse_args(argv):\n"
QUESTION = [{"role": "user", "content": "Sort a list of numbers in Python."}]


def score(target, prompt: list[int], tokens: list[int], top: int) -> list[tuple]:
    """The reference: ``(token, logprob, top alternatives)`` of each token from one forward
    without a cache over the prompt and the reply (the target's ``__call__``)."""
    logits = target(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1:].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    out = []
    for t, row in zip(tokens, logp.tolist()):
        order = sorted(range(len(row)), key=lambda i: -row[i])[:top]
        out.append((t, row[t], [(i, row[i]) for i in order]))
    return out


def close(scored, again):
    for (t, lp, alts), (t2, lp2, alts2) in zip(scored, again, strict=True):
        assert t == t2 and lp == pytest.approx(lp2, abs=2e-4)
        assert [i for i, _ in alts] == [i for i, _ in alts2]


@pytest.fixture(scope="module")
def pair():
    return md.load()


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_the_generations_scores_equal_scoring_the_reply_again(pair, speculative):
    r = md.generate(pair, PROMPT, max_tokens=24, speculative=speculative, logprobs=3)
    assert r.stats.rounds > 0 if speculative == "on" else r.stats.rounds == 0
    scored = r.stats.logprobs
    assert [t for t, _, _ in scored] == r.tokens
    prompt = md.api.make_request(pair, PROMPT).prompt
    close(scored, score(pair.target, list(prompt), r.tokens, 3))
    assert all(alts[0][1] == lp for _, lp, alts in scored)  # greedy: the most likely one


def test_sampled_tokens_are_scored_under_the_raw_distribution(pair):
    r = md.generate(pair, PROMPT, max_tokens=16, temperature=0.8, top_k=5, seed=3,
                    speculative="on", logprobs=0)
    prompt = md.api.make_request(pair, PROMPT).prompt
    again = score(pair.target, list(prompt), r.tokens, 0)
    assert [lp for _, lp, _ in r.stats.logprobs] == pytest.approx(
        [lp for _, lp, _ in again], abs=2e-4)
    assert all(alts == [] for _, _, alts in r.stats.logprobs)


@pytest.mark.parametrize("budget, max_tokens", [(3, 24), (0, 24), (2, 3), (0, 1)])
def test_a_thinking_budgets_closing_ids_are_scored_by_the_prefill_that_feeds_them(
        pair, budget, max_tokens, monkeypatch):
    # (2, 3) and (0, 1): the closing ids end the reply, scored by the prefill of them the
    # next stretch would begin with; never a second pass from the prompt on
    request = md.api.make_request(pair, QUESTION, max_tokens, logprobs=2,
                                  chat_template_kwargs={"enable_thinking": True},
                                  thinking_token_budget=budget)
    end = list(request.thinking.end)
    forwards = []
    step = type(pair.target).step
    monkeypatch.setattr(type(pair.target), "step", lambda self, tokens, *a, **k: (
        forwards.append(tokens.shape[-1]), step(self, tokens, *a, **k))[1])
    r = md.generate(pair, request)
    assert r.tokens[budget:budget + len(end)] == end[:max_tokens - budget]
    assert sum(forwards) <= len(request.prompt) + len(r.tokens)      # each token fed once
    assert [t for t, _, _ in r.stats.logprobs] == r.tokens
    close(r.stats.logprobs, score(pair.target, list(request.prompt), r.tokens, 2))


def test_a_reply_a_stop_string_ends_is_scored_from_the_generation_as_it_runs(pair):
    full = md.generate(pair, PROMPT, max_tokens=24)
    cut = pair.tokenizer.decode(full.tokens[6:9])
    tokens, scored = [], None
    for chunk in md.stream_generate(pair, PROMPT, max_tokens=24, logprobs=2, stop=[cut]):
        tokens += [] if chunk.stop else [chunk.token]
        if chunk.finish_reason is not None:     # as the server reads it, the generation alive
            assert chunk.stats.logprobs is None and chunk.stop_string == cut
            scored = logprobs.of_reply(tokens, chunk.stats)
    assert len(tokens) < 24 and [t for t, _, _ in scored] == tokens
    close(scored, score(pair.target, list(md.api.make_request(pair, PROMPT).prompt), tokens, 2))
    assert Stats().scores() is None


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3"])
def test_logprobs_must_be_a_small_count(pair, bad):
    with pytest.raises(ValueError, match="logprobs"):
        md.generate(pair, PROMPT, max_tokens=2, logprobs=bad)


def test_without_logprobs_nothing_is_scored(pair):
    assert md.generate(pair, PROMPT, max_tokens=4).stats.logprobs is None
