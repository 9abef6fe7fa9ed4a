"""The prompt cache measured (docs/prompt-cache.md): time to first token for an agent-style
workload with the cache off, in memory, and on disk, before and after a restart; snapshot
sizes and write/read times; the hostile cases tried against the cache directory.

    python benchmarks/bench_prompt_cache.py demo [--requests 10]      # real server processes
    python benchmarks/bench_prompt_cache.py realwidth DIR [--prefix 256 --requests 3]
    python benchmarks/bench_prompt_cache.py hostile [--prefix 1000]   # the hostile cases alone
    python benchmarks/bench_prompt_cache.py cost DIR [--lengths 256 1024]   # K: snapshot vs prefill

``demo``: the embedded pair behind real ``mlx-dspark serve`` processes. One system prompt with
tool definitions (about 3.8k tokens: the demo model's context is 4096), then ``--requests``
chat requests, each a different conversation after it, one answer token each; then each
server is stopped, started again on the same directory, and the same requests are sent again.
TTFT is the wall time of a non-streamed request for one token (prefill + one step), measured
by the client. Then the hostile cases: the directory spoiled five ways (a flipped byte, a cut
file, a snapshot rewritten for another model, a snapshot replaced by a symlink, a file owned by
another user) and a server whose file size limit makes every write fail (a full disk): each
must print one warning line, answer with ``cached_tokens`` 0 and the cold answer.

``realwidth DIR``: a converted Lightning-shaped checkpoint (4 layers at full widths, e.g.
``python -m testkit.synthetic SRC --pattern 'ME*M'`` then ``mlx-dspark convert``),
in this process (it has no tokenizer: token-id prompts, the prefix end given as the message
boundary); a "restart" is a new prompt cache on the same directory (empty memory, the disk
store indexed again). MLX's CPU backend prefills this checkpoint at a few tokens per second
here, so the prefix is shorter than the demo's (``--prefix``).

``cost DIR``: snapshot time, disk write and read time, and size, against the prefill time of
the same tokens, for choosing K (prompt_cache.CHECKPOINT_EVERY).
"""

from __future__ import annotations

from pathlib import Path
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout

CHAT = "/v1/chat/completions"


# ------------------------------------------------------------------------------------ demo


def agent_prefix(tokenizer, target_tokens: int) -> list[dict]:
    """A system prompt with tool definitions of about ``target_tokens`` tokens."""
    tools = []
    i = 0
    while True:
        tools.append(f"- tool `query_table_{i}(name: str, limit: int = {i}) -> list[dict]`: "
                     f"reads up to limit rows of table {i} and returns them as dicts.")
        text = "You are a coding agent. Tools:\n" + "\n".join(tools)
        n = len(tokenizer.encode(text))
        if n >= target_tokens:
            return [{"role": "system", "content": text}]
        i += 1


def conversations(n: int) -> list[list[dict]]:
    asks = ["def parse(line):", "class Table:", "write a test for load()", "import os",
            "fix the bug in query_table_3", "def merge(a, b):", "sort the rows by date",
            "explain query_table_7", "for row in rows:", "return the first ten rows"]
    out = []
    for i in range(n):
        conv = [{"role": "user", "content": asks[i % len(asks)] + f" (task {i})"}]
        if i % 3 == 1:
            conv += [{"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "and again"}]
        out.append(conv)
    return out


def _server(flags, preexec=None):
    from testkit.server import launch
    return launch(flags, timeout=120, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  preexec_fn=preexec)


def _stop(proc) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.decode(errors="replace")


def _ask(url, messages):
    t0 = time.perf_counter()
    r = httpx.post(url + CHAT, json={"messages": messages, "max_tokens": 1, "temperature": 0},
                   timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    return dt, body["usage"]["prompt_tokens_details"]["cached_tokens"], \
        body["usage"]["prompt_tokens"], body["choices"][0]["message"]["content"]


def _health(url):
    return httpx.get(url + "/health", timeout=30).json().get("prompt_cache")


def part_demo(a):
    from mlx_dspark import api
    pair = api.load()
    prefix = agent_prefix(pair.tokenizer, a.prefix)
    requests = [prefix + c for c in conversations(a.requests)]
    workdir = tempfile.mkdtemp(prefix="bench-prompt-cache-")
    modes = {"off": ["--prefix-cache-mb", "0"], "memory": [],
             "disk": ["--prompt-cache-dir", os.path.join(workdir, "cache")]}
    from mlx_dspark.text.tokenizer import _encode
    n = len(_encode(pair.tokenizer, pair.tokenizer.apply_chat_template(
        prefix, tokenize=False, add_generation_prompt=False)))
    report = {"prefix_tokens": n, "requests": a.requests, "modes": {}}
    answers = {}
    for mode, flags in modes.items():
        runs = []
        for run in ("first", "after restart"):
            proc, url = _server(flags)
            rows = [_ask(url, m) for m in requests]
            health = _health(url)
            log = _stop(proc)
            runs.append({"run": run, "ttft_s": [round(r[0], 3) for r in rows],
                         "cached_tokens": [r[1] for r in rows],
                         "prompt_tokens": [r[2] for r in rows], "health": health,
                         "warnings": [x for x in log.splitlines() if "prompt cache" in x]})
            answers.setdefault(mode, []).append([r[3] for r in rows])
        report["modes"][mode] = runs
    report["answers_equal"] = all(x == answers["off"][0] for runs in answers.values()
                                  for x in runs)
    report["hostile"] = hostile(requests[0], os.path.join(workdir, "cache"), answers["off"][0][0])
    shutil.rmtree(workdir, ignore_errors=True)
    return report


def part_hostile(a):
    """The hostile cases alone, on a directory one server run fills (a shorter prefix)."""
    from mlx_dspark import api
    pair = api.load()
    messages = agent_prefix(pair.tokenizer, a.prefix) + conversations(1)[0]
    workdir = tempfile.mkdtemp(prefix="bench-hostile-")
    proc, url = _server(["--prefix-cache-mb", "0"])
    cold = _ask(url, messages)[3]
    _stop(proc)
    proc, url = _server(["--prompt-cache-dir", os.path.join(workdir, "cache")])
    _ask(url, messages)
    _ask(url, messages[:-1] + [{"role": "user", "content": "something else"}])
    _stop(proc)
    out = hostile(messages, os.path.join(workdir, "cache"), cold)
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def hostile(messages, cache_dir, cold_answer):
    """Spoil the directory five ways (and fill the disk); each: one warning, a cold prefill,
    the cold answer."""
    from testkit import spoil

    out = {}
    for name, way in spoil.WAYS.items():
        d = tempfile.mkdtemp(prefix="spoiled-")
        shutil.copytree(cache_dir, d, dirs_exist_ok=True)
        # every snapshot this request could use is spoiled, so nothing is left to reuse
        for n in os.listdir(d):
            if n.endswith(".safetensors"):
                way(os.path.join(d, n))
        if name == "other-user" and os.getuid() != 0:
            out[name] = "skipped (needs root to change an owner)"
            continue
        proc, url = _server(["--prompt-cache-dir", d])
        dt, cached, _, answer = _ask(url, messages)
        log = _stop(proc)
        warnings = [x for x in log.splitlines() if "prompt cache" in x]
        out[name] = {"cached_tokens": cached, "answer_is_cold_answer": answer == cold_answer,
                     "warning_lines": len(warnings), "first_warning": warnings[:1],
                     "traceback": "Traceback" in log}
        shutil.rmtree(d, ignore_errors=True)

    def small_files():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    d = tempfile.mkdtemp(prefix="full-")
    proc, url = _server(["--prompt-cache-dir", d], preexec=small_files)
    first = _ask(url, messages)
    second = _ask(url, messages[:-1] + [{"role": "user", "content": "another question"}])
    log = _stop(proc)
    warnings = [x for x in log.splitlines() if "prompt cache" in x]
    out["full disk (every write fails)"] = {
        "answer_is_cold_answer": first[3] == cold_answer, "warning_lines": len(warnings),
        "first_warning": warnings[:1], "second_request_cached_from_memory": second[1],
        "files_left": os.listdir(d), "traceback": "Traceback" in log}
    shutil.rmtree(d, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------- realwidth


def _pair(path):
    from mlx_dspark import api
    from mlx_dspark.prompt_cache.disk import receipt_hash
    from mlx_dspark.models.nemotron_h import load_target
    return api.Pair(load_target(path), receipts=(receipt_hash(path), None))


def part_realwidth(a):
    import mlx.core as mx
    from mlx_dspark import api
    from mlx_dspark.prompt_cache.cache import PromptCache
    from mlx_dspark.prompt_cache.disk import open_store
    from mlx_dspark.request import Request

    pair = _pair(a.path)
    vocab = pair.target.config.vocab_size
    prefix = [int(x) for x in mx.random.randint(10, vocab, (a.prefix,), key=mx.random.key(0))]
    convs = [[int(x) for x in mx.random.randint(10, vocab, (16,), key=mx.random.key(i + 1))]
             for i in range(a.requests)]
    work = tempfile.mkdtemp(prefix="bench-realwidth-")

    def run(cache):
        p = api.Pair(pair.target, receipts=pair.receipts, prompt_cache=cache)
        rows = []
        for c in convs:
            request = Request(tuple(prefix + c), max_tokens=1, speculative="off")
            t0 = time.perf_counter()
            chunks = list(api.stream(p, request, None, boundaries=(len(prefix),)))
            rows.append((time.perf_counter() - t0, chunks[-1].stats.reused_tokens,
                         chunks[-1].token))
        return rows

    report = {"prefix_tokens": a.prefix, "conversation_tokens": 16, "modes": {}}
    tokens = {}
    # "off" holds no state: a restart changes nothing, so it is measured once
    off = run(None)
    report["modes"]["off"] = [{"run": "first and after restart", "ttft_s": _r(off),
                               "cached_tokens": [r[1] for r in off]}]
    tokens["off"] = [r[2] for r in off]
    for mode in ("memory", "disk"):
        runs = []
        for run_name in ("first", "after restart"):
            store = open_store(os.path.join(work, "cache"), pair, False, 10**10) \
                if mode == "disk" else None
            cache = PromptCache(2 << 30, store)
            rows = run(cache)
            runs.append({"run": run_name, "ttft_s": _r(rows),
                         "cached_tokens": [r[1] for r in rows], "health": cache.health()})
            tokens.setdefault(mode, []).append([r[2] for r in rows])
        report["modes"][mode] = runs
    report["first_tokens_equal_cold"] = all(t == tokens["off"] for runs in
                                            (tokens["memory"], tokens["disk"]) for t in runs)
    shutil.rmtree(work, ignore_errors=True)
    return report


def _r(rows):
    return [round(r[0], 3) for r in rows]


def part_cost(a):
    import mlx.core as mx
    from mlx_dspark.prompt_cache.disk import identity
    from mlx_dspark.prompt_cache.snapshot_file import read_snapshot, write_snapshot
    from mlx_dspark.decode.loop import prefill

    pair = _pair(a.path)
    ident = identity("bench", None, pair.target.dtype, pair.target.config.hybrid_override_pattern)
    out = {}
    work = tempfile.mkdtemp(prefix="bench-cost-")
    for n in a.lengths:
        session = pair.session()
        ids = [int(x) for x in mx.random.randint(10, pair.target.config.vocab_size, (n,),
                                                  key=mx.random.key(n))]
        t0 = time.perf_counter()
        mx.eval(prefill(session, ids, tap=False))
        t_prefill = time.perf_counter() - t0
        snaps, writes, reads = [], [], []
        for i in range(a.reps):
            t0 = time.perf_counter()
            snap = session.snapshot()
            snaps.append(time.perf_counter() - t0)
            path = os.path.join(work, f"{n}-{i}.safetensors")
            t0 = time.perf_counter()
            size = write_snapshot(path, snap, ident, "")
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back, _ = read_snapshot(path, ident)
            mx.eval(back.arrays())
            reads.append(time.perf_counter() - t0)
            os.unlink(path)
        out[n] = {"prefill_s": round(t_prefill, 3), "prefill_tok_s": round(n / t_prefill, 2),
                  "snapshot_s": round(statistics.median(snaps), 4),
                  "write_s": round(statistics.median(writes), 4),
                  "read_s": round(statistics.median(reads), 4),
                  "snapshot_bytes": snap.nbytes, "file_bytes": size,
                  # what a checkpoint every K tokens adds to prefilling those K tokens
                  "overhead_at_K": {k: round((statistics.median(snaps) +
                                              statistics.median(writes)) /
                                             (k * t_prefill / n), 4)
                                    for k in (512, 1024, 2048, 4096, 8192)}}
    shutil.rmtree(work, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------ tail


def long_request(tokenizer, system_tokens: int, user_tokens: int) -> list[dict]:
    """An agent's prompt: a system prompt, then one long last message (Python source, the
    demo model's own kind of text) of about ``user_tokens`` tokens."""
    import inspect
    import json as _json
    source = inspect.getsource(_json.decoder) + inspect.getsource(_json.encoder) + \
        inspect.getsource(inspect)
    lo, hi = 0, len(source)
    while hi - lo > 16:                 # the shortest head of the source that is long enough
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(source[:mid])) < user_tokens else (lo, mid)
    return agent_prefix(tokenizer, system_tokens) + [{"role": "user", "content": source[:hi]}]


def edited(messages: list[dict], chars_from_end: int, length: int = 40) -> list[dict]:
    """``messages`` with ``length`` characters of the last message rewritten, starting
    ``chars_from_end`` characters before its end (as an agent rewrites its last message)."""
    text = messages[-1]["content"]
    at = len(text) - chars_from_end
    new = "".join("#" if c != "\n" else c for c in text[at:at + length])
    return messages[:-1] + [{"role": "user", "content": text[:at] + new + text[at + length:]}]


def chars_for_tokens(tokenizer, text: str, tokens: int) -> int:
    """How many characters from the end of ``text`` hold its last ``tokens`` tokens."""
    lo, hi = 0, len(text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(text[-mid:])) < tokens else (lo, mid)
    return hi


def part_tail(a):
    """Re-prefilled tokens after an edit near the end of a long prompt, and after a turn
    appended, in one process on the demo pair with the default in-memory prompt cache; and
    what each checkpoint holds."""
    import mlx_dspark as md
    from mlx_dspark.prompt_cache.cache import PromptCache
    pair = md.load()
    messages = long_request(pair.tokenizer, a.system, a.tokens)
    text = messages[-1]["content"]
    cases = {"40 characters from the end": edited(messages, 40),
             f"{a.edit} tokens from the end": edited(
                 messages, chars_for_tokens(pair.tokenizer, text, a.edit))}
    out = {}
    for name, follow in cases.items():
        pair.prompt_cache = PromptCache(a.cache_mb << 20)
        first = md.generate(pair, messages, chat=True, max_tokens=2, temperature=0)
        before = len(pair.prompt_cache.memory)
        got = md.generate(pair, follow, chat=True, max_tokens=2, temperature=0)
        out[name] = {"prompt_tokens": got.stats.prompt_tokens,
                     "cached": got.stats.reused_tokens,
                     "re-prefilled": got.stats.prompt_tokens - got.stats.reused_tokens}
    memory = pair.prompt_cache.memory
    out["snapshots after the first request"] = before
    sizes = sorted((len(k), s.nbytes) for (_, k), s in memory._entries.items())
    out["snapshot bytes (tokens, nbytes)"] = sizes
    out["cache bytes (distinct arrays)"] = memory.nbytes
    pair.prompt_cache = PromptCache(a.cache_mb << 20)
    first = md.generate(pair, messages, chat=True, max_tokens=8, temperature=0)
    turn = messages + [{"role": "assistant", "content": first.text},
                       {"role": "user", "content": "Now write a test for it."}]
    got = md.generate(pair, turn, chat=True, max_tokens=2, temperature=0)
    new = got.stats.prompt_tokens - first.stats.prompt_tokens
    out["a turn appended"] = {"prompt_tokens": got.stats.prompt_tokens,
                              "cached": got.stats.reused_tokens,
                              "re-prefilled": got.stats.prompt_tokens - got.stats.reused_tokens,
                              "tokens after the previous prompt": new}
    return out


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="part", required=True)
    d = sub.add_parser("demo")
    d.add_argument("--requests", type=int, default=10)
    d.add_argument("--prefix", type=int, default=3800)
    r = sub.add_parser("realwidth")
    r.add_argument("path")
    r.add_argument("--prefix", type=int, default=256)
    r.add_argument("--requests", type=int, default=3)
    h = sub.add_parser("hostile")
    h.add_argument("--prefix", type=int, default=1000)
    c = sub.add_parser("cost")
    c.add_argument("path")
    c.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    c.add_argument("--reps", type=int, default=3)
    t = sub.add_parser("tail")
    t.add_argument("--tokens", type=int, default=8000)
    t.add_argument("--system", type=int, default=600)
    t.add_argument("--edit", type=int, default=500)
    t.add_argument("--cache-mb", type=int, default=1024)
    a = p.parse_args()
    result = {"demo": part_demo, "realwidth": part_realwidth, "cost": part_cost,
              "hostile": part_hostile, "tail": part_tail}[a.part](a)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
