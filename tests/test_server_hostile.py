"""`mlx-dspark serve` against hostile clients, as a real process: slow connections that would
exhaust its file descriptors, a client that leaves a non-streamed request, a 100 MB body, an
API key in UTF-8 bytes. (Thousands of connections and the memory of huge bodies:
benchmarks/bench_hostile.py.)"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import time

import httpx
import pytest

from testkit.server import launch

pytestmark = pytest.mark.slow

KEY = "clé"
CHAT = "/v1/chat/completions"
HARD_FILES = 512        # the server's hard open-file limit: fewer than the connections below
SLOW = 700


def _limit_files():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, HARD_FILES))


@pytest.fixture(scope="module")
def server():
    proc, url = launch(("--api-key", KEY, "--read-timeout", "3", "--max-request-mb", "1",
                        "--max-connections", "2000"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_limit_files)
    yield url, proc
    proc.terminate()
    out = proc.communicate(timeout=15)[0].decode()
    assert "Traceback" not in out, out[-3000:]


def _port(url):
    return int(url.rsplit(":", 1)[1])


def _raw(url, data: bytes, timeout=10) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _request(body: bytes, auth: bytes, length: int | None = None) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer " + auth +
            b"\r\nContent-Length: " + str(len(body) if length is None else length).encode() +
            b"\r\n\r\n" + body)


HI = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}'


def _health(url):
    return httpx.get(url + "/health", timeout=5).json()


def test_an_answer_while_more_slow_connections_are_open_than_file_descriptors(server):
    url, _ = server
    slow = []
    for _ in range(SLOW):       # half a header each, then nothing
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\0" * 8)
        s.settimeout(10)
        try:
            s.connect(("127.0.0.1", _port(url)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: local")
        except OSError:
            s.close()
            continue
        slow.append(s)
    try:
        t0 = time.monotonic()
        r = httpx.post(url + CHAT, content=HI, timeout=30, headers={
            "Authorization": f"Bearer {KEY}".encode(), "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 10
        # the ones still open are closed once their time to send a request is up
        deadline = time.monotonic() + 8
        for s in slow:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for s in slow:
            s.close()


def test_a_100_mb_body_is_refused_before_it_is_sent(server):
    url, _ = server
    t0 = time.monotonic()
    out = _raw(url, _request(b"", KEY.encode(), length=100 << 20))
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert time.monotonic() - t0 < 5


def test_the_api_key_matches_as_utf8_bytes(server):
    url, _ = server
    assert _raw(url, _request(HI, KEY.encode())).startswith(b"HTTP/1.1 200")
    assert _raw(url, _request(HI, KEY.encode("latin-1"))).startswith(b"HTTP/1.1 401")


def test_a_client_leaving_a_non_streamed_request_cancels_it(server):
    url, _ = server
    before = _health(url)["cancelled"]
    # a 9,000-token prompt: seconds of prefill even on a quiet machine, where the demo's
    # short chat answers (58 tokens, 0.2 s) would end before the client leaves
    body = json.dumps({"messages": [{"role": "user", "content": "import os\n" * 3000}],
                       "max_tokens": 100000}).encode()
    with socket.create_connection(("127.0.0.1", _port(url))) as s:
        s.sendall(_request(body, KEY.encode()))
        time.sleep(0.5)                         # prefilling
    deadline = time.monotonic() + 10
    while _health(url)["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(url)["cancelled"] > before, "the generation went on after the client left"
    assert httpx.post(url + CHAT, content=HI, timeout=30, headers={
        "Authorization": KEY.encode(), "Content-Type": "application/json"}).status_code == 401
