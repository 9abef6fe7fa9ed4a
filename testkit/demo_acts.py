"""The demo pair's held-out behaviour checks (issue 41): tool calls through a real server's
tool path (OpenAI chat completions: the tools rendered by the chat template, a forced call's
prefill and grammar, the calls parsed out of the reply), thinking that closes, and text that
does not loop (``md.generate``). ``tests/test_demo_acts.py`` pins the shipped demo to them and
``benchmarks/bench_demo_acts.py`` prints them. The tool sets, requests and chat prompts here are
held out: ``training/tool_data.py`` and ``training/chat_data.py`` never draw them."""

from __future__ import annotations

import json


def function(name, description, params, required=None):
    """An OpenAI function tool from (name, JSON type, description) parameter triples."""
    props = {k: {"type": t, "description": d} for k, t, d in params}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props,
                       "required": required or [params[0][0]]}}}


# Names, parameter names and descriptions that no training tool set uses.
HELDOUT_TOOLS = [
    [function("show_source", "Show what a file holds.", [("location", "string", "Which file")]),
     function("invoke", "Start a program in the shell.",
              [("commandline", "string", "What to start")])],
    [function("browse", "Show what a folder holds.", [("where", "string", "Which folder")]),
     function("slurp", "Load a whole file as text.", [("target", "string", "Which file")])],
    [function("console_send", "Send a line to the terminal.",
              [("input_line", "string", "The line")]),
     function("dump", "Put text into a file.", [("dest", "string", "The file"),
                                                ("payload", "string", "The text")],
              ["dest", "payload"])],
]
# (tool set, request, the tool to call, the argument it must carry, the tool's result)
HELDOUT_REQUESTS = [
    (0, "What does parser.py contain?", "show_source", "parser.py",
     "import re\n\n\ndef parse(text):\n    return re.split(r'\\s+', text)\n"),
    (1, "Which files are in the folder src?", "browse", "src", "main.py\nutil.py\nREADME.md"),
    (0, "Start the tests with `pytest -x`.", "invoke", "pytest -x", "5 passed in 0.31s"),
    (2, "Write hello into greeting.txt.", "dump", "greeting.txt", "Wrote 5 bytes to greeting.txt"),
    (1, "Can you read config/settings.ini for me?", "slurp", "config/settings.ini",
     "[server]\nport = 8080\n"),
]
# Held-out chat requests (none from the corpus's docstrings or training/prompts.json).
CHAT_PROMPTS = [
    "Write a function that returns the last element of a list.",
    "Write a function that converts Celsius to Fahrenheit.",
    "Write a function that checks whether a string is a palindrome.",
    "Write a function that returns the average of a list of numbers.",
    "Write a function that counts the words in a sentence.",
    "Write a function that returns the n-th triangular number.",
    "How do I sort a dictionary by its values in Python?",
    "Write a function that splits a list into chunks of size n.",
    "Write a function that returns True if a year is a leap year.",
    "Write a function that capitalizes every word in a string.",
    "Write a function that returns the greatest common divisor of two numbers.",
    "Implement a function that flattens a dictionary of dictionaries.",
    "Write a function that reads a CSV file and returns its rows.",
    "Write a function that returns the second largest number in a list.",
    "How do I check if a file exists in Python?",
    "Write a function that removes all whitespace from a string.",
    "Write a function that returns the keys of a dictionary sorted.",
    "Write a class for a counter with increment and reset methods.",
    "Write a function that returns the index of the smallest item.",
    "Write a function that joins a list of paths with slashes.",
]
# The README's and docs' example prompts as their commands send them: a chat turn (generate -p,
# chat, serve's messages) or raw text (the Python API's string prompts, --ignore-chat-template).
EXAMPLE_CHATS = ["Write a function that reverses a string.", "def fibonacci(n):",
                 "def quicksort(xs):", "def is_prime(n):"]
EXAMPLE_HISTORY = [{"role": "user", "content": "Write a function that reverses a string."},
                   {"role": "assistant", "content": "```python\ndef reverse(s):\n    return s[::-1]\n```"},
                   {"role": "user", "content": "Now make it recursive."}]
EXAMPLE_RAW = ["def is_prime(n):", "def main():", "def fibonacci(n):", "def f(x):"]
CALL_TOKENS = 64        # a forced call closes within this many tokens
ANSWER_TOKENS = 128     # the answer after a tool's result ends within this many
THINK_TOKENS = 64       # thinking closes within this many
LOOP_TOKENS = 64        # distinct 4-grams measured over this many greedy tokens


def distinct_4grams(tokens) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def tool_checks(client, model: str) -> list[dict]:
    """Per held-out request, through the server: the call on "auto" (its tool and argument),
    a forced call (``tool_choice: "required"``, CALL_TOKENS at most: did it close, i.e. come
    back as a parsed call), and the answer after the tool's result (its finish reason and
    length, ANSWER_TOKENS at most)."""
    out = []
    for k, ask, name, arg, result in HELDOUT_REQUESTS:
        tools, messages = HELDOUT_TOOLS[k], [{"role": "user", "content": ask}]
        row = {"request": ask}
        auto = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                              max_tokens=CALL_TOKENS, temperature=0)
        calls = auto.choices[0].message.tool_calls or []
        got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        row["auto_calls"] = got
        row["right"] = any(n == name and arg in [str(v).strip() for v in a.values()]
                           for n, a in got)
        forced = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                                tool_choice="required", max_tokens=CALL_TOKENS,
                                                temperature=0)
        row["forced_closed"] = bool(forced.choices[0].message.tool_calls)
        row["forced_tokens"] = forced.usage.completion_tokens
        args = next((a for n, a in got if n == name), None) or {
            next(iter(t["function"]["parameters"]["properties"])): arg
            for t in tools if t["function"]["name"] == name}
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]
        after = client.chat.completions.create(model=model, messages=history, tools=tools,
                                               max_tokens=ANSWER_TOKENS, temperature=0)
        row["answer_finish"] = after.choices[0].finish_reason
        row["answer_tokens"] = after.usage.completion_tokens
        row["answer"] = after.choices[0].message.content
        out.append(row)
    return out


def thinking_checks(client, model: str, temperature: float = 0.0, seed: int | None = None,
                    asks: list[tuple[str, list | None]] | None = None) -> list[dict]:
    """With thinking on, through the server: per held-out chat prompt (no tools) and per
    held-out tool request (its tools offered, as an agent sends them), the thought's length
    in tokens (its closing tag included) and whether the reply wrote a thought, closed it
    within THINK_TOKENS and then answered (text or a call). Greedy unless ``temperature``
    (then sampled with ``seed``), as an agent such as Claude Code samples at 1. ``asks``:
    other (request, tools or None) pairs instead of the held-out ones."""
    asks = asks or [(p, None) for p in CHAT_PROMPTS[:5]] + [(ask, HELDOUT_TOOLS[k])
                                                            for k, ask, *_ in HELDOUT_REQUESTS]
    out = []
    for ask, tools in asks:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ask}], max_tokens=THINK_TOKENS + 64,
            temperature=temperature, seed=seed,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            **({"tools": tools} if tools else {}))
        m = r.choices[0].message
        thought = (m.model_extra or {}).get("reasoning_content") or ""
        spent = r.usage.completion_tokens_details.reasoning_tokens
        answered = bool((m.content or "").strip() or m.tool_calls)
        out.append({"prompt": ask, "tools": bool(tools), "thought": thought,
                    "thinking_tokens": spent, "answered": answered,
                    "closed": bool(thought.strip()) and spent <= THINK_TOKENS and answered})
    return out


def loop_checks(pair) -> dict:
    """Distinct 4-gram share of LOOP_TOKENS greedy tokens (an answer that ends sooner counts
    what it wrote) on the example prompts and the held-out chat prompts: each, worst, mean;
    and the pair's drafter's tokens per round over them all (generated tokens over rounds).
    The runs speculate throughout: greedy text is the serial text, token for token."""
    import mlx_dspark as md

    def run(prompt, **chat):
        return md.generate(pair, prompt, LOOP_TOKENS, speculative=True, **chat)
    runs = [(p, run(p, chat=True)) for p in EXAMPLE_CHATS]
    runs.append(("(history) Now make it recursive.", run(EXAMPLE_HISTORY)))
    runs += [(f"(raw) {p}", run(p)) for p in EXAMPLE_RAW]
    runs += [(p, run(p, chat=True)) for p in CHAT_PROMPTS]
    each = {p: round(distinct_4grams(r.tokens), 3) for p, r in runs}
    rate = sum(len(r.tokens) for _, r in runs) / sum(r.stats.rounds for _, r in runs)
    return {"worst": min(each.values()), "mean": round(sum(each.values()) / len(each), 3),
            "each": each, "tokens_per_round": round(rate, 3)}


def served(load=None, speculative: str = "on", cache_bytes: int = 0):
    """The real app and engine in this process on the pair ``load()`` returns (default: the
    demo pair), and the official ``openai`` client on it: (engine, client); stop the engine
    when done. ``cache_bytes``: its prompt cache (agents' requests share 9,000-token
    prefixes)."""
    import openai
    from starlette.testclient import TestClient

    from mlx_dspark import api
    from mlx_dspark.serve.app import create_app
    from mlx_dspark.serve.engine import Engine

    engine = Engine(load or api.load, max_queue=4, cache_bytes=cache_bytes)
    engine.start()
    http = TestClient(create_app(engine, "mlx-dspark-demo", defaults={"speculative": speculative}),
                      base_url="http://localhost")
    return engine, openai.OpenAI(base_url="http://localhost/v1", api_key="k", max_retries=0,
                                 http_client=http)
