"""The prompt cache from the command line and over HTTP, for real: ``cache-prompt`` then
``chat --resume``, ``/save`` and ``/load`` across processes, and ``serve --prompt-cache-dir``
across a restart, with snapshots shared only within one API key and ``cache_salt``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from testkit import spoil
from testkit.server import launch, stop

pytestmark = pytest.mark.slow       # subprocesses and servers

SCRIPT = str(Path(sys.executable).parent / "mlx-dspark")
STATUS = re.compile(r"prompt (\d+) tokens: (\d+) prefilled, (\d+) reused")
SYSTEM = "You review Python. " + " ".join(f"def helper_{i}(rows): return rows[{i}]"
                                          for i in range(30))


def run(*args, stdin=""):
    return subprocess.run([SCRIPT, *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_a_cached_prompt_and_a_saved_chat_resume_in_new_processes(tmp_path):
    d = ["--prompt-cache-dir", str(tmp_path)]
    made = run("cache-prompt", "-p", SYSTEM, "-o", "reviewer", *d)
    assert made.returncode == 0, made.stderr
    saved = int(re.search(r"saved (\d+) tokens", made.stdout).group(1))
    first = run("chat", "--resume", "reviewer", "-m", "8", *d,
                stdin="def parse(line):\n/save mine\n/quit\n")
    assert first.returncode == 0, first.stderr
    prompt, prefilled, reused = map(int, STATUS.search(first.stdout).groups())
    assert reused == saved and prefilled == prompt - saved      # the system prompt not again
    held = int(re.search(r"saved (\d+) tokens of state", first.stdout).group(1))
    again = run("chat", "--resume", "mine", "-m", "8", *d, stdin="class A:\n/quit\n")
    assert again.returncode == 0, again.stderr
    prompt, prefilled, reused = map(int, STATUS.search(again.stdout).groups())
    assert reused == held and prefilled == prompt - held


def test_resuming_a_name_never_saved_is_one_line_and_exit_1(tmp_path):
    r = run("chat", "--resume", "nothing", "--prompt-cache-dir", str(tmp_path), stdin="/quit\n")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "no saved conversation named 'nothing'" \
        in r.stderr


def test_a_cache_dir_that_is_a_file_is_one_line_and_exit_1(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = run("serve", "--prompt-cache-dir", str(f), "--port", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("mlx-dspark serve: error: "
                                                        "--prompt-cache-dir")


def _chat(url, messages, key=None, salt=None):
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], \
        body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_serve_keeps_snapshots_across_a_restart_within_one_key_and_salt(tmp_path):
    def conversation(q):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]

    flags = ["--prompt-cache-dir", str(tmp_path)]
    proc, url = launch(flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cold, cached = _chat(url, conversation("def parse(line):"), salt="team-a")
        assert cached == 0
        _, cached = _chat(url, conversation("class A:"), salt="team-b")
        assert cached == 0                  # another salt: another user's snapshots
        _, cached = _chat(url, conversation("class A:"), key="k2", salt="team-a")
        assert cached == 0                  # another key
    finally:
        proc.terminate()
        proc.wait(30)
    proc, url = launch(flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        again, cached = _chat(url, conversation("def parse(line):"), salt="team-a")
        assert cached > 0 and again == cold     # from disk, after a restart
        _, cached = _chat(url, conversation("import os"))
        assert cached == 0                      # no salt, no key: a space of its own
        r = httpx.post(url + "/v1/chat/completions", json={
            "messages": conversation("x"), "cache_salt": ""}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        health = httpx.get(url + "/health").json()["prompt_cache"]
        assert health["disk"]["bytes"] <= health["disk"]["budget_bytes"]
        assert health["found"]["disk"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_starts_and_answers_cold_on_a_directory_of_spoiled_headers(tmp_path):
    """Issue 35: a flipped ``tokens`` key kept the server from starting, and a flipped
    ``data_offsets`` key gave every request with that prefix a 500."""
    def conversation(q):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]

    d = tmp_path / "cache"
    flags = ["--prompt-cache-dir", str(d)]
    proc, url = launch(flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cold = _chat(url, conversation("def parse(line):"))[0]
        first_answer = _chat(url, conversation("class A:"))[0]
    finally:
        stop(proc)
    files = sorted(d.glob("*.safetensors"))
    for f in files:
        spoil.renamed_key(str(f))               # every snapshot: a layer's key
    shutil.copy(files[0], d / "copy.safetensors")
    spoil.flip_in_header(str(d / "copy.safetensors"), b'"data_offsets"', 12, 0x01,
                         after=b'"tokens"')     # and one with the tokens' key
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc, url = launch(flags, stdout=subprocess.DEVNULL, stderr=err)
        try:
            assert _chat(url, conversation("def parse(line):"))[0] == cold
            assert _chat(url, conversation("def parse(line):"))[0] == cold    # again: no 500
            assert _chat(url, conversation("class A:"))[0] == first_answer
        finally:
            stop(proc)
    text = log.read_text()
    assert "Traceback" not in text
    warnings = [line for line in text.splitlines() if "prompt cache:" in line]
    assert len(warnings) == 1 and f"{len(files) + 1} file(s) not used" in warnings[0], text
