"""What the agents' tests share: an in-process server on the scripted stand-in target (it
writes chosen replies, calls included, through the real loop, engine and app) or on the demo
pair, the captured client requests (tests/fixtures/agents/), and server-sent events read
back."""

from __future__ import annotations

import json
from pathlib import Path

from starlette.testclient import TestClient

from mlx_dspark import api
from mlx_dspark.serve.engine import Engine
from testkit.scripted import ScriptedTarget
from mlx_dspark.text.tokenizer import load_tokenizer
from testkit.server_helpers import app_client

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "agents"
THOUGHT = "Thinking it over.\n</think>\n"
NO_TOOLS = "A plain answer."
SENT_BY_CLIENT = {"host", "content-length", "content-type"}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def agent_replies(tokenizer, replies: list[str]):
    """A ``choose`` for the scripted target: after k tool results the reply is
    ``replies[k]`` (the last once they run out); a prompt without tools gets
    :data:`NO_TOOLS`; a prompt that opens a thinking block gets :data:`THOUGHT` first."""
    def choose(ids):
        text = tokenizer.decode(ids)
        reply = replies[min(text.count("<tool_response>"), len(replies) - 1)] \
            if "# Tools" in text else NO_TOOLS
        if text.endswith("<think>\n"):
            reply = THOUGHT + reply
        return tokenizer.encode(reply, add_special_tokens=False)
    return choose


def scripted_engine(replies: list[str], cache_bytes: int = 0) -> Engine:
    tokenizer = load_tokenizer(api.DEMO / "target")
    target = ScriptedTarget(4096, agent_replies(tokenizer, replies), tokenizer.eos_token_id)
    engine = Engine(lambda: api.Pair(target, None, tokenizer), max_queue=4,
                    cache_bytes=cache_bytes, use_drafter=False)
    engine.start()
    return engine


def client(engine: Engine, name: str = "mlx-dspark-demo", **options) -> TestClient:
    return app_client(engine, name, **options)


def replay(client: TestClient, request: dict, **body):
    """Send a captured request as the client sent it (its path, headers and body; ``body``
    overrides fields)."""
    headers = {k: v for k, v in request["headers"].items() if k.lower() not in SENT_BY_CLIENT}
    return client.post(request["path"], json={**request["body"], **body}, headers=headers)


def events(text: str) -> list[tuple[str | None, object]]:
    """(event name or None, data) of a server-sent event stream; comments are skipped,
    ``[DONE]`` is kept as a string."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            joined = "\n".join(data)
            out.append((name, joined if joined == "[DONE]" else json.loads(joined)))
    return out


def submitted(engine: Engine, monkeypatch) -> list:
    """The jobs the app submits to ``engine`` from now on."""
    jobs, real = [], engine.submit

    def spy(job):
        jobs.append(job)
        return real(job)
    monkeypatch.setattr(engine, "submit", spy)
    return jobs
