"""What the server refuses before any work, in process (the app on the demo pair, driven by
starlette's test client): foreign Host, a browser Origin not allowed, a body that is not
JSON or too large or too deep, a request's own chat template or tokenizer arguments, text
that cannot fit the context; and the API key's rules."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mlx_dspark.serve.app import create_app
from mlx_dspark.serve.http_guard import Exposure
from testkit.server_helpers import app_client, started_engine

KEY = "clé-secrète"                  # non-ASCII: sent as UTF-8 bytes
AUTH = {"Authorization": f"Bearer {KEY}".encode()}
CHAT = "/v1/chat/completions"
ORIGIN = "https://app.example"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def engine():
    yield from started_engine(max_queue=4)


@pytest.fixture(scope="module")
def client(engine):
    return app_client(engine, "demo", KEY, exposure=Exposure(
        hosts=frozenset({"llm.internal"}), origins=frozenset({ORIGIN}), max_body=1 << 20))


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def test_a_plain_request_is_served(client):
    r = client.post(CHAT, json=HI, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("host", ["localhost:5001", "127.0.0.1:1", "[::1]:5001", "llm.internal"])
def test_local_names_and_allowed_hosts_are_served(client, host):
    assert client.post(CHAT, json=HI, headers={**AUTH, "Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:5001", "10.1.2.3"])
def test_a_foreign_host_is_refused_dns_rebinding(client, host):
    _error(client.post(CHAT, json=HI, headers={**AUTH, "Host": host}), 403, "host_not_allowed")


def test_a_server_on_every_address_takes_any_ip_but_not_a_foreign_name():
    every = Exposure(bound="0.0.0.0")
    assert every.host_allowed("192.168.1.20:5001") and every.host_allowed("[fe80::1]:80")
    assert not every.host_allowed("rebind.attacker.example:5001")
    assert Exposure(bound="192.168.1.20").host_allowed("192.168.1.20:5001")


def test_a_browser_origin_is_refused_unless_allowed(client):
    _error(client.post(CHAT, json=HI, headers={**AUTH, "Origin": "https://evil.example"}),
           403, "origin_not_allowed")
    r = client.post(CHAT, json=HI, headers={**AUTH, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_an_allowed_origin_gets_its_preflight_answered(client):
    r = client.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "Authorization" in r.headers["access-control-allow-headers"]
    assert client.options(CHAT, headers={"Origin": "https://evil.example"}).status_code == 403


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_declared_json_gets_415(client, kind):
    headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
    _error(client.post(CHAT, content=json.dumps(HI), headers=headers), 415,
           "unsupported_media_type")


def test_a_body_over_the_limit_gets_413_by_its_length(client):
    body = json.dumps({**HI, "pad": "x" * (2 << 20)})
    _error(client.post(CHAT, content=body, headers={**AUTH, "Content-Type": "application/json"}),
           413, "request_too_large")


def test_a_chunked_body_over_the_limit_gets_413_while_it_is_read(client):
    sent = []

    def chunks():
        for _ in range(64):             # 4 MB offered, 64 KB at a time
            sent.append(1)
            yield b" " * (64 << 10)

    r = client.post(CHAT, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    _error(r, 413, "request_too_large")


def test_json_nested_100k_deep_is_a_400_not_a_500(client):
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = _error(client.post(CHAT, content=body, headers={
        **AUTH, "Content-Type": "application/json"}), 400)
    assert "deeper" in err["message"]


@pytest.mark.parametrize("kwargs", [
    {"chat_template": "{% for i in range(99999) %}{{ i }}{% endfor %}"},
    {"tokenize": True}, {"add_generation_prompt": False}])
def test_a_request_cannot_bring_a_template_or_tokenizer_arguments(client, kwargs):
    err = _error(client.post(CHAT, json={**HI, "chat_template_kwargs": kwargs}, headers=AUTH),
                 400, param="chat_template_kwargs")
    assert next(iter(kwargs)) in err["message"]


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(engine, monkeypatch):
    client = app_client(engine, "demo", KEY,
                        exposure=Exposure(max_body=8 << 20))      # the text is over 1 MB
    encoded = []
    monkeypatch.setattr(engine.pair.tokenizer._tokenizer, "encode",
                        lambda *a, **k: encoded.append(1) or [1])
    limit = engine.pair.target.context_limit
    longest = max(map(len, engine.pair.tokenizer.get_vocab()))
    text = "a" * (limit * longest + 1)
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text})):
        _error(client.post(path, json=body, headers=AUTH), 400, "context_length_exceeded")
    assert not encoded


@pytest.mark.parametrize("auth", [{}, {"Authorization": b"Bearer cl\xc3\xa9"},
                                  {"Authorization": "Bearer cle-secrete"}])
def test_a_wrong_key_gets_401_and_a_non_ascii_key_matches_its_utf8_bytes(client, auth):
    _error(client.post(CHAT, json=HI, headers=auth), 401, "invalid_api_key")
    assert client.post(CHAT, json=HI, headers=AUTH).status_code == 200


def test_an_empty_api_key_is_refused_at_start(engine):
    with pytest.raises(ValueError):
        create_app(engine, "demo", "")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mlx_dspark.cli", "serve", "--api-key", ""],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and time.monotonic() - t0 < 30


def _anthropic_error(r, status, kind):
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert "code" not in r.json()["error"]          # not OpenAI's shape
    return r.json()["error"]["message"]


def test_anthropic_clients_get_anthropic_errors_from_the_guards_too(client):
    messages = "/v1/messages"
    body = json.dumps({"model": "demo", "max_tokens": 3, "messages": HI["messages"],
                       "pad": "x" * (2 << 20)})
    headers = {"x-api-key": KEY.encode(), "Content-Type": "application/json"}
    assert "larger than" in _anthropic_error(client.post(messages, content=body,
                                                         headers=headers),
                                             413, "request_too_large")
    _anthropic_error(client.post(messages, json={}, headers={**headers, "Host": "evil.example"}),
                     403, "permission_error")
    _anthropic_error(client.post(messages, json={}, headers={**headers,
                                                             "Origin": "https://evil.example"}),
                     403, "permission_error")
    _anthropic_error(client.post(messages, content=b"{}", headers={
        "x-api-key": KEY.encode(), "Content-Type": "text/plain"}), 415, "invalid_request_error")
    # and the OpenAI routes keep OpenAI's shape for the same refusals
    _error(client.post(CHAT, json=HI, headers={**AUTH, "Host": "evil.example"}), 403,
           "host_not_allowed")
