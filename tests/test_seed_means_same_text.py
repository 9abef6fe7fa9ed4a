"""A seed means the same text (issue 25, item 3): with a seed and no explicit ``sampling``,
every mode (serial, speculative, and "auto" whatever its timings decide) gives the same text,
through the API, the command line and the request defaults; the seed used, given or drawn, is
returned in the stats and printed by ``--stats``. Demo pair."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.request import Request

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def pair():
    return md.load()


def test_a_seed_picks_reproducible_sampling_unless_asked_otherwise():
    assert Request([1], seed=5, temperature=1.0).sampling == "reproducible"
    assert Request([1], temperature=1.0).sampling == "rejection"
    assert Request([1], seed=5, sampling="rejection").sampling == "rejection"


def test_a_seed_gives_the_same_text_in_every_mode(pair):
    texts = {mode: md.generate(pair, PROMPT, max_tokens=40, temperature=1.0, seed=5,
                               speculative=mode).text for mode in ("off", "on", "auto")}
    assert texts["off"] == texts["on"] == texts["auto"]
    assert texts["off"] != md.generate(pair, PROMPT, max_tokens=40, temperature=1.0, seed=6,
                                       speculative="off").text


def test_the_seed_used_is_returned_given_or_drawn(pair):
    res = md.generate(pair, PROMPT, max_tokens=20, temperature=1.0, seed=5)
    assert (res.stats.seed, res.stats.sampling) == (5, "reproducible")
    assert res.stats.as_dict()["seed"] == 5
    drawn = md.generate(pair, PROMPT, max_tokens=20, temperature=1.0, speculative="off")
    assert drawn.stats.sampling == "rejection" and isinstance(drawn.stats.seed, int)
    again = md.generate(pair, PROMPT, max_tokens=20, temperature=1.0, speculative="off",
                        seed=drawn.stats.seed, sampling="rejection")
    assert again.tokens == drawn.tokens
    assert md.generate(pair, PROMPT, max_tokens=3).stats.seed is None      # greedy: none used


def test_stats_print_the_scheme_and_the_seed(capsys):
    assert cli.main(["generate", "-p", PROMPT, "-m", "4", "--temp", "1", "--seed", "5",
                     "--stats"]) == 0
    assert "\nsampling: reproducible, seed 5\n" in capsys.readouterr().err
    assert cli.main(["generate", "-p", PROMPT, "-m", "4", "--temp", "1", "--stats",
                     "--sampling", "rejection"]) == 0
    assert "\nsampling: rejection, seed " in capsys.readouterr().err


def test_the_command_line_gives_the_same_text_in_every_mode_for_a_seed(capsys):
    texts = set()
    for mode in ("off", "on", "auto"):
        assert cli.main(["generate", "-p", PROMPT, "-m", "30", "--temp", "1", "--seed", "5",
                         "--speculative", mode]) == 0
        texts.add(capsys.readouterr().out)
    assert len(texts) == 1


def test_a_seeded_server_request_under_auto_is_the_serial_text(pair):
    from starlette.testclient import TestClient

    from mlx_dspark.serve.engine import Engine
    from mlx_dspark.serve.app import create_app

    engine = Engine(lambda: pair, max_queue=2, cache_bytes=0)
    engine.start()
    try:
        client = TestClient(create_app(engine, "m", defaults={"speculative": "auto",
                                                              "num_draft": 3}),
                            base_url="http://localhost")      # a Host naming the server
        got = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 30,
                                                   "temperature": 1.0, "seed": 5}).json()
    finally:
        engine.stop()
    want = md.generate(pair, PROMPT, max_tokens=30, temperature=1.0, seed=5, speculative="off")
    assert got["choices"][0]["text"] == want.text
    assert got["dspark"]["seed"] == 5 and got["dspark"]["sampling"] == "reproducible"
