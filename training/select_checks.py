"""Step 3d's validation sets for every ship bar that a checkpoint can fail by chance: choose among
tune checkpoints here, then confirm the choice once on testkit/demo_acts.py's held-out bars.

The bars are small (29 loop prompts, 5 forced calls, 10 thoughts) and a tune moves which of their
prompts fail from one checkpoint to the next, so picking the checkpoint that passes them would
make the held-out prompts a training signal. These sets are the same measures on other prompts:
none is a testkit or prompts.json prompt or a paraphrase of one (such as "def g(y):" for the
bar's "def f(x):"), and no tool name is a testkit or training/tool_data.py one:
- loops: distinct 4-grams in LOOP_TOKENS greedy tokens on loop_validation.py's 24 prompts and on
  24 written in the bar's own style (18 requests through the chat template, 6 raw def lines);
- forced calls: ``tool_choice: "required"`` through the real server on 8 requests and 3 tool sets
  of other names, closed within CALL_TOKENS;
- thinking: with thinking on, 5 requests without tools and 3 with, closed within THINK_TOKENS and
  then answered.

    PYTHONPATH=<testkit's parent>:training $RT training/select_checks.py training/work/cands/NAME ...
"""
import argparse

import mlx_dspark as md

import loop_validation
from testkit.demo_acts import CALL_TOKENS, function, served, thinking_checks

ASKS = [
    "Write a function that swaps the keys and values of a dictionary.",
    "Write a function that checks whether a list is sorted.",
    "Write a function that checks whether a number is even.",
    "Write a function that returns the absolute difference of two numbers.",
    "Write a function that counts the digits in a number.",
    "Write a function that returns the smallest of three numbers.",
    "How do I merge two dictionaries in Python?",
    "Write a function that returns the last n lines of a file.",
    "Write a function that returns the number of days in a month.",
    "Write a function that lowercases every key of a dictionary.",
    "Write a function that returns the current time as a string.",
    "Write a function that writes a list of lines to a file.",
    "How do I get the current date in Python?",
    "Write a function that replaces tabs with four spaces.",
    "Write a function that returns the largest value of a dictionary.",
    "Write a class for a queue with enqueue and dequeue methods.",
    "Write a function that repeats a string n times.",
    "Write a function that returns the length of the longest word.",
]
RAW = ["def reset(self):", "def load(path):", "def add(a, b):", "def parse(text):", "def setup():", "def count(items):"]
TOOLS = [
    [function("peek_file", "Print the text of a file.", [("file_name", "string", "The file to print")]),
     function("run_cmd", "Run a shell command.", [("cmd", "string", "The command")])],
    [function("scan_folder", "List a directory.", [("dir_path", "string", "The directory")]),
     function("fetch_text", "Return a file's contents.", [("which", "string", "The file")])],
    [function("terminal_exec", "Execute a line in a terminal.", [("line", "string", "The line to run")]),
     function("store_text", "Save text to a file.", [("filename", "string", "Where to save"),
                                                      ("body", "string", "What to save")], ["filename", "body"])],
]
REQUESTS = [(0, "Show me the file utils.py."), (0, "Run `make build`."), (1, "What is inside the docs folder?"),
            (1, "Open notes.txt please."), (2, "Execute `git status`."), (2, "Save 'done' into status.txt."),
            (0, "Print setup.cfg."), (1, "List the directory tests.")]
THOUGHTS = [(a, None) for a in ASKS[:5]] + [(a, TOOLS[k]) for k, a in REQUESTS[:3]]


def loops(pair) -> list[float]:
    chats, raw = loop_validation.prompts()
    return loop_validation.shares(pair, chats + ASKS, raw + RAW)


def acts(client) -> tuple[int, int]:
    """(forced calls closed, thoughts closed then answered), as the bars count them."""
    forced = 0
    for k, ask in REQUESTS:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], tools=TOOLS[k],
                                           tool_choice="required", max_tokens=CALL_TOKENS, temperature=0)
        forced += bool(r.choices[0].message.tool_calls)
    return forced, sum(r["closed"] for r in thinking_checks(client, "m", asks=THOUGHTS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", help="folders holding target/ and drafter/")
    for cand in ap.parse_args().pairs:
        def load():
            return md.load(f"{cand}/target", f"{cand}/drafter")
        engine, client = served(load)
        try:
            forced, closed = acts(client)
        finally:
            engine.stop()
        shares = loops(load())
        print(f"{cand}: forced {forced}/{len(REQUESTS)} thoughts {closed}/{len(THOUGHTS)} loops worst {min(shares):.3f} "
              f"mean {sum(shares) / len(shares):.3f} under 0.5: {sum(s < 0.5 for s in shares)} of {len(shares)}",
              flush=True)


if __name__ == "__main__":
    main()
