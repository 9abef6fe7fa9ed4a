"""Two real `mlx-dspark serve` replicas on 127.0.0.1 behind LiteLLM's Router, built from the
`config.yaml` of docs/serve.md ("Beyond one Mac") with the addresses swapped for the replicas':
requests reach both replicas, each answer is the one the same request gets sent straight to a
replica, a conversation with a session id stays on one replica (its prompt cache serves the
later turns), and LiteLLM opens no connection outside loopback. Needs the `replicas` extra."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from testkit.server import launch, stop

pytestmark = pytest.mark.slow

KEY = "replica-key"
SERVE_MD = Path(__file__).resolve().parents[1] / "docs" / "serve.md"
PROMPTS = ["def fibonacci(n):", "class Stack:", "import numpy as np\n", "SELECT name FROM"]


def _loopback(host) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@pytest.fixture(scope="module")
def offline():
    """Every name lookup and connection of this process must stay on loopback (this machine has
    no internet, so one that does not would hang or fail): LiteLLM fetches its model cost map
    at import unless told to use the copy it ships."""
    outside = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kw):
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and not _loopback(name):
            outside.append(name)
            raise OSError(f"test: no network outside loopback ({name})")
        return real_getaddrinfo(host, *args, **kw)

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            outside.append(address[0])
            raise OSError(f"test: no network outside loopback ({address[0]})")
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        mp.setenv("MLX_DSPARK_API_KEY", KEY)
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        mp.setattr(socket.socket, "connect", connect)
        yield outside


@pytest.fixture(scope="module")
def litellm(offline):
    return pytest.importorskip("litellm")


@pytest.fixture(scope="module")
def replicas():
    # --speculative on: a seeded request then draws the same tokens whatever the controller's
    # timings on a loaded machine (two replicas, two machines' worth of timings)
    started = [launch(["--api-key", KEY, "--speculative", "on"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL) for _ in range(2)]
    yield [url for _, url in started]
    for proc, _ in started:
        stop(proc)


def _config(urls):
    """docs/serve.md's config.yaml, each deployment's api_base replaced by a replica's."""
    config = yaml.safe_load(SERVE_MD.read_text().split("```yaml\n# config.yaml\n", 1)[1]
                            .split("```", 1)[0])
    assert len(config["model_list"]) == len(urls)
    for deployment, url in zip(config["model_list"], urls):
        deployment["litellm_params"]["api_base"] = url + "/v1"
    return config


@pytest.fixture
def router(litellm, replicas):
    # one per test: least-busy's in-flight counts and the session pins start empty
    config = _config(replicas)
    return litellm.Router(model_list=config["model_list"], **config["router_settings"])


def _health(url) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.load(r)


def _served(url) -> int:
    return _health(url)["served"]


def _direct(url, prompt, **kw) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="lightning", messages=[{"role": "user",
                                                                     "content": prompt}], **kw)
    return r.choices[0].message.content


GREEDY = dict(temperature=0, max_tokens=12)
SEEDED = dict(temperature=0.8, top_p=0.95, max_tokens=12, seed=1234)


def test_requests_reach_both_replicas_with_the_answers_each_gives_directly(router, replicas,
                                                                          offline):
    before = [_served(u) for u in replicas]
    want = {}
    for prompt in PROMPTS:
        for name, kw in (("greedy", GREEDY), ("seeded", SEEDED)):
            answers = {_direct(u, prompt, **kw) for u in replicas}
            assert len(answers) == 1, (prompt, name, answers)   # the replicas agree
            want[prompt, name] = answers.pop()
    assert len({want[p, "greedy"] for p in PROMPTS}) > 1     # the prompts are told apart
    direct = [_served(u) - b for u, b in zip(replicas, before)]
    assert direct == [2 * len(PROMPTS)] * 2

    async def through_router():
        # concurrent: least-busy sends each request to the replica with fewer in flight
        jobs = [(p, name, kw) for p in PROMPTS for name, kw in (("greedy", GREEDY),
                                                              ("seeded", SEEDED))]
        replies = await asyncio.gather(*(router.acompletion(
            model="lightning", messages=[{"role": "user", "content": p}], **kw)
            for p, _, kw in jobs))
        return {(p, name): r.choices[0].message.content
                for (p, name, _), r in zip(jobs, replies)}

    got = asyncio.run(through_router())
    assert got == want
    routed = [_served(u) - b - d for u, b, d in zip(replicas, before, direct)]
    assert sum(routed) == len(want) and min(routed) >= 1, routed
    assert offline == []


NO_EOS = {"2": -100}   # the demo's end of sequence never drawn: the long request stays long


def _until_a_replica_decodes(replicas):
    """Returns once a replica's /health shows a row in its batch (the request is in flight)."""
    while not any(_health(u)["batch"]["size"] for u in replicas):
        time.sleep(0.01)


def test_a_session_stays_on_its_replica_and_its_prompt_cache(router, replicas, offline):
    before = {u: _served(u) for u in replicas}
    messages = [{"role": "system", "content": "You complete Python code."},
                {"role": "user", "content": "def fibonacci(n):"}]

    def ask(messages, salt):
        return router.acompletion(model="lightning", messages=messages, extra_body={
            "cache_salt": salt}, metadata={"session_id": "conversation-1"}, **GREEDY)

    async def conversation():
        # a long request keeps one replica busy while the first turn is routed, so least-busy
        # sends that turn to the other; later turns find both idle, where least-busy alone
        # would take the first replica again: only the session pin keeps them where they were
        busy = asyncio.create_task(router.acompletion(model="lightning", messages=[
            {"role": "user", "content": "Write a long story."}], temperature=0, max_tokens=256,
            logit_bias=NO_EOS))
        await asyncio.to_thread(_until_a_replica_decodes, replicas)
        turns = []
        for turn in range(3):
            r = await ask(messages, "user-a")
            turns.append(r)
            messages.extend([{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"Go on ({turn})."}])
            if turn == 0:
                busy = await busy
        return busy, turns

    busy, turns = asyncio.run(conversation())
    assert busy.usage.completion_tokens == 256          # it did not end by itself
    busy_url = busy._hidden_params["api_base"].removesuffix("/v1")
    (session_url,) = set(replicas) - {busy_url}
    assert {r._hidden_params["api_base"] for r in turns} == {session_url + "/v1"}
    # the replicas' own counts say the same: one request on the busy one, three on the other
    assert {u: _served(u) - before[u] for u in replicas} == {busy_url: 1, session_url: 3}
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in turns]
    assert cached[0] == 0 and min(cached[1:]) > 0, cached
    # the salt reaches the replica: another user's identical conversation finds nothing cached
    other = asyncio.run(ask(messages[:-2], "user-b"))
    assert other._hidden_params["api_base"] == session_url + "/v1"
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert offline == []
