"""The server honours the sampling knobs mlx-lm's server and OpenAI's API take
(``repetition_penalty``, ``repetition_context_size``, ``min_p``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``) on chat and completions: each reaches the request as
sent, a value outside its meaning is a 400 naming it, and the endpoints that cannot honour
them (Responses, Messages) still refuse a non-zero one. On the demo pair, speculating under
"auto", a penalised completion is the serial text of the same options from Python."""

from __future__ import annotations

import pytest

import mlx_dspark as md
from testkit.agent_helpers import client, scripted_engine, submitted
from testkit.server_helpers import app_client, started_engine

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        COMPLETIONS: {"prompt": "hi", "max_tokens": 8},
        RESPONSES: {"input": "hi", "max_output_tokens": 8}}
KNOBS = {"repetition_penalty": 1.3, "repetition_context_size": 12, "min_p": 0.05,
         "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"5": 2, "11": -100}}


@pytest.fixture(scope="module")
def engine():
    engine = scripted_engine(["Hello there."])
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def c(engine):
    return client(engine)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_knob_reaches_the_request_as_sent(c, engine, monkeypatch, path):
    jobs = submitted(engine, monkeypatch)
    r = c.post(path, json={**BASE[path], **KNOBS})
    assert r.status_code == 200, r.text
    request = jobs[-1].request
    assert (request.repetition_penalty, request.repetition_context_size, request.min_p,
            request.presence_penalty, request.frequency_penalty) == (1.3, 12, 0.05, 0.5, -0.25)
    assert request.logit_bias == ((5, 2.0), (11, -100.0))


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", "1"),
    ("repetition_penalty", 0), ("repetition_penalty", 1e-38), ("repetition_penalty", 1e-45),
    ("repetition_penalty", 1e4), ("repetition_context_size", 0),
    ("repetition_context_size", 1.5),
    ("min_p", 1.5), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"5": True}), ("logit_bias", {"999999": 1})])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_knob_outside_its_meaning_is_a_400_naming_it(c, path, field, value):
    r = c.post(path, json={**BASE[path], field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field,value", [("frequency_penalty", 0.5), ("presence_penalty", 1),
                                         ("logit_bias", {"5": 1})])
def test_an_endpoint_that_cannot_honour_a_penalty_refuses_it(c, field, value):
    r = c.post(RESPONSES, json={**BASE[RESPONSES], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert c.post(RESPONSES, json={**BASE[RESPONSES], field: 0 if field != "logit_bias"
                                   else {}}).status_code == 200


def test_a_penalised_completion_is_the_serial_text_while_speculating():
    pair = md.load()
    prompt, options = "def fibonacci(n):\n", dict(repetition_penalty=1.4, presence_penalty=0.6,
                                                 frequency_penalty=0.2, min_p=0.1)
    for engine in started_engine(lambda: pair, max_queue=2):
        server = app_client(engine, "m", defaults={"speculative": "on", "num_draft": 3})
        got = server.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 30,
                                             "temperature": 0, **options}).json()
    want = md.generate(pair, prompt, max_tokens=30, speculative="off", **options)
    assert got["choices"][0]["text"] == want.text
    assert want.text != md.generate(pair, prompt, max_tokens=30, speculative="off").text
