"""Log-probabilities are read off the rows the generation computed (Request.logprobs): the
same numbers as scoring the reply again with the target, in serial and speculative decoding,
without a second pass over the prompt and reply."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from mlx_dspark.serve import logprobs

PROMPT = "def parse_args(argv):\n"


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
    again = logprobs.score(pair.target, list(prompt), r.tokens, 3)
    for (t, lp, alts), (t2, lp2, alts2) in zip(scored, again):
        assert t == t2 and lp == pytest.approx(lp2, abs=2e-4)
        assert [i for i, _ in alts] == [i for i, _ in alts2]
        assert alts[0][1] == lp           # greedy: the chosen token is the most likely one


def test_sampled_tokens_are_scored_under_the_raw_distribution(pair):
    r = md.generate(pair, PROMPT, max_tokens=16, temperature=0.8, top_k=5, seed=3,
                    speculative="on", logprobs=0)
    prompt = md.api.make_request(pair, PROMPT).prompt
    again = logprobs.score(pair.target, list(prompt), r.tokens, 0)
    assert [lp for _, lp, _ in r.stats.logprobs] == pytest.approx(
        [lp for _, lp, _ in again], abs=2e-4)
    assert all(alts == [] for _, _, alts in r.stats.logprobs)


def test_a_reply_the_loop_did_not_all_choose_is_scored_again(pair):
    r = md.generate(pair, PROMPT, max_tokens=8, logprobs=2)
    request = md.api.make_request(pair, PROMPT, logprobs=2)
    shifted = [(t + 1, lp, alts) for t, lp, alts in r.stats.logprobs]   # not these tokens
    assert logprobs.of_reply(pair.target, request, r.tokens, shifted) == \
        logprobs.score(pair.target, list(request.prompt), r.tokens, 2)
    assert logprobs.of_reply(pair.target, request, r.tokens, r.stats.logprobs) == \
        r.stats.logprobs


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3"])
def test_logprobs_must_be_a_small_count(pair, bad):
    with pytest.raises(ValueError, match="logprobs"):
        md.generate(pair, PROMPT, max_tokens=2, logprobs=bad)


def test_without_logprobs_nothing_is_scored(pair):
    assert md.generate(pair, PROMPT, max_tokens=4).stats.logprobs is None
