"""Real coding agents against ``mlx-dspark serve`` (issue 30): one tool-using turn of Claude
Code and of Codex CLI, the prompt-cache reuse between two Claude Code sessions, and the time
to first byte and keep-alive cadence of a streamed /v1/messages request on a long prompt.

    python benchmarks/bench_agents.py [--dir benchmarks/agents] [--long 27000] [--json OUT]
    python benchmarks/bench_agents.py --together    # Claude Code and opencode in one batch
    python benchmarks/bench_agents.py --demo        # Codex and opencode on the demo pair itself

The clients are installed with npm into ``--dir`` (its ``package.json`` pins them; never into
the runtime), and each runs in a fresh ``HOME`` with a dummy key: no login, no network beyond
127.0.0.1. The default turns run on the scripted stand-in target (``testkit.scripted``: it
writes a call to the client's shell tool, then an answer), to time the clients and the
prompt cache; ``--demo`` runs Codex and opencode on the demo pair, whose calls and answers are
the model's own (issue 41; its transcript is docs/serve.md's). The long prompt runs on the demo
pair, and the request is dropped after ``--pings`` keep-alives (its prefill stops at the next
piece). Without npm on PATH it says so and exits 1."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testkit.server import launch, stop  # noqa: E402

PACKAGES = {"@anthropic-ai/claude-code": "2.1.197", "@openai/codex": "0.171.0",
            "opencode-ai": "1.18.33"}
ANSWER = "README.md is the only file here."
CALL = "<tool_call>\n<function={name}>\n<parameter={key}>\nls\n</parameter>\n</function>\n</tool_call>"
FIXTURE = ROOT / "tests" / "fixtures" / "agents" / "claude_code.json"


def install(folder: Path) -> dict:
    """The clients' executables, npm-installed into ``folder`` (once)."""
    if shutil.which("npm") is None:
        sys.exit("bench_agents.py: npm is not on PATH. Claude Code, Codex and opencode are npm "
                 "packages; install Node.js (with npm) to run them.")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text(json.dumps(
        {"name": "mlx-dspark-agents-bench", "private": True, "dependencies": PACKAGES},
        indent=2) + "\n")
    (folder / ".gitignore").write_text("node_modules/\npackage-lock.json\n")
    bins = {name: folder / "node_modules" / ".bin" / name
            for name in ("claude", "codex", "opencode")}
    if not all(b.exists() for b in bins.values()):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=folder, check=True)
    claude = folder / "node_modules" / "@anthropic-ai" / "claude-code"
    if subprocess.run([bins["claude"], "--version"], capture_output=True).returncode != 0:
        subprocess.run(["node", "install.cjs"], cwd=claude, check=True)   # its postinstall
    return bins


def scripted(replies: list[str], cache_mb: int = 0):
    path = Path(tempfile.mkdtemp()) / "replies.json"
    path.write_text(json.dumps(replies))
    return launch(["--prefix-cache-mb", str(cache_mb)],
                  command=("testkit.scripted", str(path)),
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def workdir() -> tuple[Path, Path]:
    home, work = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    (work / "README.md").write_text("# demo\n")
    return home, work


def claude_turns(claude: Path) -> dict:
    """One turn (a Bash call, its result, the answer), then a second session in the same
    project (same ``HOME`` and folder, as a user's next session; its billing header differs):
    the usage of each API call, from ``--output-format stream-json``."""
    proc, url = scripted([CALL.format(name="Bash", key="command"), ANSWER], cache_mb=256)
    home, work = workdir()
    env = dict(os.environ, HOME=str(home), PWD=str(work), ANTHROPIC_BASE_URL=url,
               ANTHROPIC_API_KEY="sk-local", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    out = {}
    try:
        for run, prompt in (("first", "List the files here"), ("second", "What is in here?")):
            t0 = time.monotonic()
            r = subprocess.run([claude, "--allowedTools", "Bash", "--output-format",
                                "stream-json", "--verbose", "-p", prompt], cwd=work, env=env,
                               capture_output=True, text=True, timeout=300)
            lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
            calls, seen = [], set()
            for m in (x["message"] for x in lines if x.get("type") == "assistant"):
                if m["id"] not in seen:          # one line per content block: once per call
                    seen.add(m["id"])
                    calls.append({k: m["usage"].get(k) for k in
                                  ("input_tokens", "cache_read_input_tokens")})
            result = next((x for x in lines if x.get("type") == "result"), {})
            out[run] = {"exit": r.returncode, "seconds": round(time.monotonic() - t0, 1),
                        "result": result.get("result", r.stdout[-300:]),
                        "turns": result.get("num_turns"), "calls": calls}
    finally:
        stop(proc)
    return out


def codex_env(url: str, model: str = "gpt-5.5") -> tuple[Path, dict]:
    """A project folder and the environment that points Codex at ``url`` (docs/serve.md)."""
    home, work = workdir()
    config = home / "codex"
    config.mkdir()
    (config / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "dspark"\n\n[model_providers.dspark]\n'
        f'name = "mlx-dspark"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        'env_key = "DSPARK_API_KEY"\n')
    return work, dict(os.environ, HOME=str(home), PWD=str(work), CODEX_HOME=str(config),
                      DSPARK_API_KEY="sk-local")


def codex_turn(codex: Path) -> dict:
    proc, url = scripted([CALL.format(name="exec_command", key="cmd"), ANSWER])
    work, env = codex_env(url)
    try:
        t0 = time.monotonic()
        r = subprocess.run([codex, "exec", "--skip-git-repo-check", "List the files here"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop(proc)
    text = r.stdout + r.stderr
    return {"exit": r.returncode, "seconds": round(time.monotonic() - t0, 1),
            "ran_ls": "README.md" in text, "answered": ANSWER in text, "tail": text[-600:]}


def opencode_config(work: Path, url: str, max_tokens: int) -> None:
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": "dspark/mlx-dspark-demo",
        "provider": {"dspark": {"npm": "@ai-sdk/openai-compatible", "name": "mlx-dspark",
                                "options": {"baseURL": f"{url}/v1", "apiKey": "sk-local"},
                                "models": {"mlx-dspark-demo": {
                                    "name": "mlx-dspark demo",
                                    "limit": {"context": 65536, "output": max_tokens}}}}}}))


def demo_turns(bins: dict, pair: str | None = None, timeout: float = 600) -> dict:
    """Codex (``codex exec --json``, Responses API) and opencode (``opencode run``, chat
    completions) on the demo pair (or ``pair``: a folder holding target/ and drafter/) through
    ``serve``: the calls the model chose, what the client ran, and its answer. One server, each
    reply capped at 256 tokens (the clients send no limit); the turns run one after the other."""
    where = ["--model", f"{pair}/target", "--drafter", f"{pair}/drafter"] if pair else []
    proc, url = launch([*where, "--max-tokens", "256"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    out = {}
    try:
        work, env = codex_env(url, "mlx-dspark-demo")
        (work / "main.py").write_text("print('hello')\n")
        r = subprocess.run([bins["codex"], "exec", "--json", "--skip-git-repo-check",
                            "List the files here"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=timeout)
        events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        items = [e["item"] for e in events if e.get("type") == "item.completed"]
        out["codex"] = {"exit": r.returncode, "events": events,
                        "ran": [i["command"] for i in items if i["type"] == "command_execution"],
                        "answer": next((i["text"] for i in reversed(items)
                                        if i["type"] == "agent_message"), None)}
        home, work = workdir()
        opencode_config(work, url, 256)
        r = subprocess.run([bins["opencode"], "run", "Read README.md and say what this project is."],
                           cwd=work, env=dict(os.environ, HOME=str(home), PWD=str(work)),
                           capture_output=True, text=True, timeout=timeout)
        out["opencode"] = {"exit": r.returncode, "output": r.stdout + r.stderr}
    finally:
        stop(proc)
    return out


def together(bins: dict, prompt: str = "Read README.md and say what this project is.",
             max_tokens: int = 256, seconds: float = 300) -> dict:
    """Claude Code (Anthropic Messages, adaptive thinking) and opencode (chat completions)
    against one ``serve --max-batch 4`` on the demo pair at once: each client's exit and
    answer, and the batch as /health showed it while both ran (``both_in_one_batch``: a
    moment with a row of each client's route in it, prefilling or decoding)."""
    proc, url = launch(["--max-batch", "4"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    home, work = workdir()
    opencode_config(work, url, max_tokens)
    # each reply bounded (the demo model writes until its limit): the point is the batch
    env = dict(os.environ, HOME=str(home), PWD=str(work), ANTHROPIC_BASE_URL=url,
               ANTHROPIC_API_KEY="sk-local", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(max_tokens))
    runs = {"claude_code": [bins["claude"], "--allowedTools", "Read", "-p", prompt],
            "opencode": [bins["opencode"], "run", prompt]}
    batches, t0 = [], time.monotonic()
    try:
        procs = {name: subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                 for name, cmd in runs.items()}
        with httpx.Client(base_url=url, timeout=30) as http:
            while any(p.poll() is None for p in procs.values()) and \
                    time.monotonic() - t0 < seconds:
                batches.append({r["route"] for r in http.get("/health").json()["batch"]["rows"]})
                time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        stop(proc)
    out = {name: {"exit": p.wait(), "tail": p.stdout.read()[-400:]} for name, p in procs.items()}
    both = {"/v1/messages", "/v1/chat/completions"}       # Claude Code's and opencode's
    together = [b for b in batches if both <= b]
    return {**out, "seconds": round(time.monotonic() - t0, 1), "samples": len(batches),
            "both_in_one_batch": bool(together),
            "share_of_samples_with_both": round(len(together) / max(1, len(batches)), 3)}


def long_prompt(tokens: int, pings: int) -> dict:
    """Claude Code's first request, its user turn padded to about ``tokens`` prompt tokens,
    streamed to the demo pair: when its first byte and each keep-alive arrive."""
    request = json.loads(FIXTURE.read_text())["requests"][0]
    body = dict(request["body"], max_tokens=64)
    proc, url = launch(["--prefix-cache-mb", "1024"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            base = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
            text = _padded(http, body, tokens)
            body["messages"] = [dict(body["messages"][0], content=[
                *body["messages"][0]["content"], {"type": "text", "text": text}]),
                *body["messages"][1:]]
            size = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
            seen, t0 = [], time.monotonic()
            with http.stream("POST", "/v1/messages", json=body,
                             headers={"anthropic-version": "2023-06-01"}) as r:
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        seen.append((line[7:], round(time.monotonic() - t0, 2)))
                        if sum(1 for n, _ in seen if n == "ping") >= pings or \
                                line[7:] == "content_block_start":
                            break
    finally:
        stop(proc, timeout=600)     # the prefill left stops at its next piece (4096 tokens)
    pings_at = [t for n, t in seen if n == "ping"]
    return {"prompt_tokens": size, "base_tokens": base,
            "first_byte_s": seen[0][1] if seen else None, "first_event": seen[0][0] if seen
            else None, "pings_at_s": pings_at,
            "ping_gaps_s": [round(b - a, 2) for a, b in zip(pings_at, pings_at[1:])]}


def _padded(http: httpx.Client, body: dict, tokens: int) -> str:
    """Python source that brings ``body``'s prompt to about ``tokens`` tokens."""
    def count(text):
        return http.post("/v1/messages/count_tokens", json={**body, "messages": [dict(
            body["messages"][0], content=[*body["messages"][0]["content"],
                                          {"type": "text", "text": text}]),
            *body["messages"][1:]]}).json()["input_tokens"]
    unit = "".join(f"def f{i}(x):\n    return x * {i} + 1\n\n" for i in range(50))
    base, text = count(""), ""
    per = max(1, count(unit) - base)
    while (n := count(text)) < tokens:
        text += unit * max(1, (tokens - n) // per)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "benchmarks" / "agents")
    p.add_argument("--long", type=int, default=27000, help="prompt tokens (0: skip)")
    p.add_argument("--pings", type=int, default=4)
    p.add_argument("--json", type=Path)
    p.add_argument("--together", action="store_true",
                   help="only Claude Code and opencode at once against one batched server")
    p.add_argument("--demo", action="store_true",
                   help="only Codex and opencode on the demo pair, the model choosing the calls")
    p.add_argument("--pair", metavar="DIR", help="with --demo: this pair (DIR/target, DIR/drafter)")
    args = p.parse_args(argv)
    bins = install(args.dir)
    if args.together or args.demo:
        print(json.dumps(together(bins) if args.together else demo_turns(bins, args.pair),
                         indent=2))
        return
    report = {"claude_code": claude_turns(bins["claude"]), "codex": codex_turn(bins["codex"])}
    if args.long:
        report["long_prompt"] = long_prompt(args.long, args.pings)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
