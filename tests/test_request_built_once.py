"""One carrier of options (issue 29, item 2): an HTTP request's options are read once, at the
route, into one ``Request`` (the server's defaults merged in there), and the batch (the one
driver: decode/batch.py) decodes that very Request: nothing after the route rebuilds it (a completion's thinking, a padded
vocabulary's limit) or reads an option again. In process: the app on the demo pair."""

from __future__ import annotations

import pytest

from mlx_dspark import api
from mlx_dspark.decode.batch import Batch
from mlx_dspark.request import Request
from mlx_dspark.serve.app import create_app
from testkit.server_helpers import app_client, started_engine

USER = [{"role": "user", "content": "def greet(name):"}]
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}),
    "completion": ("/v1/completions", {"prompt": "def f(x):\n<think>\n", "max_tokens": 3}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "def greet(name):", "max_output_tokens": 3}),
}


@pytest.fixture(scope="module")
def engine():
    yield from started_engine(max_queue=2)


@pytest.fixture
def seen(engine, monkeypatch):
    """What one test's requests did: every Request made (``made``), the Request of every
    job the engine was handed (``queued``) and of every row the batch started (``decoded``)."""
    record = {"made": [], "queued": [], "decoded": []}
    post_init, submit, start = Request.__post_init__, engine.submit, Batch._start

    def made(self):
        post_init(self)
        record["made"].append(self)

    def queued(job):
        record["queued"].append(job.request)
        submit(job)

    def decoded(self, session, request, *a, **k):
        record["decoded"].append(request)
        return start(self, session, request, *a, **k)

    monkeypatch.setattr(Request, "__post_init__", made)
    monkeypatch.setattr(engine, "submit", queued)
    monkeypatch.setattr(Batch, "_start", decoded)
    return record


def _client(engine, **defaults):
    return app_client(engine, "demo", defaults=defaults)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ROUTES)
def test_each_route_builds_one_request_and_the_loop_decodes_that_one(engine, seen, route,
                                                                    stream):
    path, body = ROUTES[route]
    r = _client(engine).post(path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    assert len(seen["made"]) == 1, f"{len(seen['made'])} Requests made for one {route}"
    assert seen["decoded"] == seen["queued"] == seen["made"]
    assert seen["decoded"][0] is seen["made"][0]


def test_a_completion_keeps_its_thinking_as_text_in_the_one_request(engine, seen):
    path, body = ROUTES["completion"]
    assert _client(engine).post(path, json=body).status_code == 200
    (request,) = seen["made"]
    assert request.thinking is None      # the prompt opens a block; a completion is its text


def test_a_padded_vocabulary_is_limited_in_the_request_the_route_built(engine, seen,
                                                                       monkeypatch):
    limit = engine.pair.target.config.vocab_size - 96
    monkeypatch.setattr(engine.pair, "decodable", limit)     # a tokenizer short of the model
    path, body = ROUTES["chat"]
    assert _client(engine).post(path, json=body).status_code == 200
    (request,) = seen["made"]
    assert request.vocab_limit == limit and seen["decoded"] == [request]


def test_temperature_goes_from_the_body_or_the_servers_default_to_the_decoded_request(
        engine, seen):
    client = _client(engine, temperature=0.25, top_p=0.9, num_draft=2)
    path, body = ROUTES["chat"]
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, "temperature": 0.5}).status_code == 200
    path, body = ROUTES["messages"]      # Anthropic's own default, not the server's
    assert client.post(path, json=body).status_code == 200
    default, given, anthropic = seen["decoded"]
    assert (default.temperature, default.top_p, default.num_draft) == (0.25, 0.9, 2)
    assert (given.temperature, given.top_p) == (0.5, 0.9)
    assert (anthropic.temperature, anthropic.top_p, anthropic.num_draft) == (1.0, 1.0, 2)


def test_a_server_default_that_is_no_request_field_is_refused_naming_it(engine):
    with pytest.raises(ValueError, match="'temprature' is not a request default"):
        create_app(engine, "demo", defaults={"temprature": 0.2})


def test_split_thinking_false_gives_the_thinking_as_text(engine):
    pair = engine.pair
    split = api.generate(pair, "<think>\n", max_tokens=12, temperature=0)
    whole = api.generate(pair, "<think>\n", max_tokens=12, temperature=0, split_thinking=False)
    assert split.reasoning and whole.tokens == split.tokens
    assert whole.reasoning == "" and whole.text.startswith(split.reasoning)
    with pytest.raises(ValueError, match="split_thinking must be True or False"):
        api.make_request(pair, "hi", split_thinking="no")


@pytest.mark.parametrize("route", ROUTES)
def test_sampling_values_are_checked_once_and_every_step_reads_that_one_sampler(
        engine, seen, route, monkeypatch):
    """A request's sampling values take one shape (``Request.warping``, a Sampler made and
    checked when the Request is) and are checked once: the row decodes with that very
    Sampler, its draws and its noise read it, nothing builds another from the values."""
    from mlx_dspark import request as request_module
    from mlx_dspark.decode.run import Row

    checks, rows, begin = [], [], Row.begin
    real = request_module.check_sampling

    def counted(*a, **k):
        checks.append(a)
        return real(*a, **k)

    def began(self, request, *a, **k):
        rows.append(begin(self, request, *a, **k))
        return rows[-1]

    monkeypatch.setattr(request_module, "check_sampling", counted)
    monkeypatch.setattr(Row, "begin", began)
    path, body = ROUTES[route]
    r = _client(engine).post(path, json={**body, "temperature": 0.7})
    assert r.status_code == 200, r.text
    (request,) = seen["made"]
    assert len(checks) == 1, f"sampling checked {len(checks)} times for one {route}"
    assert checks[0][:3] == (0.7, request.top_p, request.top_k)
    (row,) = rows
    assert row.sampler is request.warping and row.noise.sampler is request.warping
