"""Real agents' turns on the demo pair without the agents (issue 41, item 4): the requests Codex
and opencode sent on a tool-using turn, recorded whole (``testkit/agents/``), with the user's
request, the working folder, the call and the tool's output swapped, sent through the official
``openai`` client to a server (the Responses API for Codex, chat completions for opencode).
``agent_checks`` asks each held-out request: does the reply call the agent's tool with the
command or file the user named, and after the tool's result, does a short answer end?
``training/agent_data.py`` draws its training turns from the same recordings and framing, with
tool_data's phrasings, none of them one of AGENT_REQUESTS."""

from __future__ import annotations

import functools
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "agents"
AGENTS = ("codex", "opencode")
CALL_TOKENS = 64
ANSWER_TOKENS = 128
# (agent, request, action, the file, folder or command it names, the tool's output)
AGENT_REQUESTS = [
    ("codex", "Which files does this project have?", "list", "", "README.md\nmain.py\n"),
    ("codex", "Start the tests with `pytest -x`.", "run", "pytest -x", "3 passed in 0.12s\n"),
    ("codex", "What does setup.py contain?", "read", "setup.py",
     "from setuptools import setup\n\nsetup(name='demo')\n"),
    ("opencode", "Read README.md and say what this project is.", "read", "README.md",
     "# demo\n\nA small command line tool.\n"),
    ("opencode", "Start `make test`.", "run", "make test", "ok\n"),
    ("opencode", "Which files are in the folder src?", "list", "src", "app.py\nutil.py\n"),
]
CWD = "/home/ada/project"


@functools.cache
def recorded(agent: str) -> dict:
    return json.loads((HERE / f"{agent}.json").read_text())


def call(agent: str, action: str, arg: str) -> tuple[str, dict]:
    """The tool the agent offers for ``action`` and its arguments: Codex runs everything
    through ``exec_command`` (``ls`` to list, ``cat`` to read); opencode runs and lists through
    ``bash`` and reads with ``read`` (a relative path: it resolves it against its folder)."""
    shell = {"run": arg, "list": f"ls {arg}".strip(), "read": f"cat {arg}"}[action]
    if agent == "codex":
        return "exec_command", {"cmd": shell}
    if action == "read":
        return "read", {"filePath": arg}
    return "bash", {"command": shell}


def framed(agent: str, name: str, out: str, cwd: str, arg: str, rng=None) -> str:
    """A tool's output as the agent sends it back (``rng``: vary Codex's chunk id and time)."""
    if agent == "codex":
        chunk, wall = (rng.getrandbits(24), rng.randrange(10**4)) if rng else (0xa1b2c3, 12)
        return (f"Chunk ID: {chunk:06x}\nWall time: 0.{wall:04d} seconds\nProcess exited with "
                f"code 0\nOriginal token count: {max(1, len(out) // 4)}\nOutput:\n{out}\n")
    if name == "read":
        lines = out.splitlines()
        body = "\n".join(f"{i + 1}: {x}" for i, x in enumerate(lines))
        return (f"<path>{cwd}/{arg}</path>\n<type>file</type>\n<content>\n{body}\n\n"
                f"(End of file - total {len(lines)} lines)\n</content>")
    return out


def body_of(agent: str, ask: str, cwd: str, call_=None, result: str = "") -> dict:
    """The agent's recorded request with ``ask`` as the user's turn and ``cwd`` as its folder;
    with ``call_`` ((name, arguments)), the request after that call's ``result``."""
    rec = recorded(agent)
    index = 0 if call_ is None else 2 if call_[0] == "read" else 1
    body = json.loads(json.dumps(rec["requests"][index]).replace(rec["cwd"], cwd))
    items = body["input"] if agent == "codex" else body["messages"]
    user = next(i for i in reversed(items) if i.get("role") == "user")
    if agent == "codex":
        user["content"][0]["text"] = ask
    else:
        quoted = user["content"].startswith('"')     # opencode run quotes its message
        user["content"] = f'"{ask}"' if quoted else ask
    if call_ is not None:
        name, args = call_
        if agent == "codex":
            items[-2]["arguments"] = json.dumps(args)
            items[-1]["output"] = result
        else:
            items[-2]["tool_calls"][0]["function"].update(name=name, arguments=json.dumps(args))
            items[-1]["content"] = result
    return body


def send(client, agent: str, body: dict, max_tokens: int) -> dict:
    """``body`` through the official client, whole (not streamed), greedy (the agents send no
    temperature, and ``serve`` takes the demo's from its generation_config.json: greedy): the
    calls, the text, and whether the reply ended on its own."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    if agent == "codex":
        extra = {k: body.pop(k) for k in ("client_metadata",) if k in body}
        r = client.responses.create(**body, max_output_tokens=max_tokens, temperature=0,
                                    extra_body=extra)
        calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
        return {"calls": calls, "text": r.output_text, "ended": r.status == "completed",
                "tokens": r.usage.output_tokens}
    body.pop("max_tokens", None)
    r = client.chat.completions.create(**body, max_tokens=max_tokens, temperature=0)
    m = r.choices[0].message
    return {"calls": [(c.function.name, json.loads(c.function.arguments))
                      for c in m.tool_calls or []], "text": m.content or "",
            "ended": r.choices[0].finish_reason in ("stop", "tool_calls"),
            "tokens": r.usage.completion_tokens}


def agent_checks(client) -> list[dict]:
    """Per held-out request: the calls the reply made (``right``: the agent's tool for the
    action, its main argument naming what the user named), then the answer after that call's
    result (``answered``: text, no call, ended within ANSWER_TOKENS)."""
    out = []
    for agent, ask, action, arg, result in AGENT_REQUESTS:
        name, args = call(agent, action, arg)
        got = send(client, agent, body_of(agent, ask, CWD), CALL_TOKENS)
        right = any(n == name and str(next(iter(a.values()), "")).strip() == next(iter(args.values()))
                    for n, a in got["calls"])
        after = send(client, agent, body_of(agent, ask, CWD, (name, args),
                                            framed(agent, name, result, CWD, arg)), ANSWER_TOKENS)
        out.append({"agent": agent, "request": ask, "calls": got["calls"], "right": right,
                    "call_text": got["text"],
                    "answer": after["text"], "answer_tokens": after["tokens"],
                    "answered": bool(after["text"].strip()) and not after["calls"]
                    and after["ended"] and after["tokens"] < ANSWER_TOKENS})
    return out
