"""Issue 41.6, hub errors: a missing or mistyped repo id says "repository not found" naming
it, a gated one says so, and offline (HF_HUB_OFFLINE, or a Hub that cannot be reached) says
so at once. ``HF_ENDPOINT`` points the real huggingface_hub client at a stub that answers as
the Hub does (its status codes and ``X-Error-Code`` headers) and counts the requests, so
"at once" is counted in attempts, never in seconds."""

from __future__ import annotations

import http.server
import os
import socket
import struct
import subprocess
import sys
import threading

import pytest

ERRORS = {  # repo -> (status, X-Error-Code), as huggingface.co answers a HEAD of a file
    "nobody/nothing": (401, "RepoNotFound"),     # the Hub's answer to a mistyped id, signed out
    "nvidia/no-such-model": (404, "RepoNotFound"),
    "meta-llama/gated": (403, "GatedRepo"),
}


class _Hub(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_HEAD(self):
        if "/resolve/" not in self.path:           # huggingface_hub's own registry look-ups
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.seen.append(self.path)
        repo = "/".join(self.path.strip("/").split("/")[:2])
        status, code = ERRORS.get(repo, (404, "RepoNotFound"))
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", "from the stub")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    _Hub.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Hub.seen
    server.shutdown()


@pytest.fixture
def unreachable():
    """An endpoint that resets every connection once the request line came (as a dropped
    network answers); yields its URL and the paths asked."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted, stop = [], threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.settimeout(5)
            accepted.append(conn.recv(4096).split(b" ")[1].decode())
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()                                     # RST: a network error

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    thread.join()
    listener.close()


def _convert(tmp_path, repo, **env):
    full = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    full.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"),
                MLX_DSPARK_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-m", "mlx_dspark.cli", "convert", repo,
                           "-o", str(tmp_path / "out")], capture_output=True, text=True,
                          env=full, timeout=120)


@pytest.mark.parametrize("repo", ["nobody/nothing", "nvidia/no-such-model"])
def test_a_missing_or_mistyped_repo_says_repository_not_found_naming_it(tmp_path, hub, repo):
    url, seen = hub
    p = _convert(tmp_path, repo, HF_ENDPOINT=url)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"repository not found: {repo}" in p.stderr
    assert "401 Client Error" not in p.stderr
    assert len(seen) == 1                         # asked once, never retried


def test_a_gated_repo_says_it_is_gated_and_how_to_get_in(tmp_path, hub):
    url, seen = hub
    p = _convert(tmp_path, "meta-llama/gated", HF_ENDPOINT=url)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "meta-llama/gated is a gated repository" in p.stderr and "hf auth login" in p.stderr
    assert len(seen) == 1


def test_hf_hub_offline_says_offline_without_asking_the_hub(tmp_path, hub):
    url, seen = hub
    p = _convert(tmp_path, "nvidia/no-such-model", HF_ENDPOINT=url, HF_HUB_OFFLINE="1")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "offline: HF_HUB_OFFLINE is set and nvidia/no-such-model is not in the local " \
           "Hugging Face cache" in p.stderr
    assert "check your connection" not in p.stderr and seen == []


def test_an_unreachable_hub_says_offline_after_one_attempt(tmp_path, unreachable):
    url, accepted = unreachable
    p = _convert(tmp_path, "nvidia/some-model", HF_ENDPOINT=url)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"offline: {url} cannot be reached and nvidia/some-model is not in the local " \
           f"Hugging Face cache" in p.stderr
    files = [path for path in accepted if "/resolve/" in path]
    assert len(files) == 1                        # huggingface_hub's own retries 5 times
