"""Chat-formatted code tasks built from the corpus: "Write a function that <its docstring's
summary>." -> the function's source, rendered with the demo target's own chat template.

Every function of the corpus split with a one-line docstring summary that reads as an
instruction ("Return the ...", "Parse a ...") becomes a task; the user turn asks for it in one
of a few phrasings, the assistant turn is the function's source in a Python code block, then
eos. The prompt is rendered by transformers' ``apply_chat_template`` with the shipped
``chat_template.jinja`` (``add_generation_prompt``; thinking off as the runtime's default
render for this pair, sometimes on with an empty thinking block, sometimes a system turn or an
earlier exchange), so the tokens are exactly the ones ``mlx-dspark chat`` sends. Held-out tasks
come from the held-out files.
"""
import ast
import json
import random
import re
import textwrap
from functools import lru_cache

from data import HERE, WORK

DEMO = HERE.parent / "mlx_dspark" / "demo" / "target"
SEED = 1357
MAX_SOURCE_CHARS = 700
MAX_TOKENS = 320      # prompt + answer; longer draws are redrawn
NOT_VERBS = {"Whether", "True", "False", "The", "This", "That", "An", "If", "Helper", "Internal",
             "Private", "Same", "Like", "Used", "Called", "Hook", "Convenience", "Default", "Wrapper"}
SUMMARY = re.compile(r"^([A-Z][a-z]+)( [A-Za-z0-9_ ,'`()/-]+)\.?$")
ASKS = ["Write a function that {s}.", "Write a Python function that {s}.",
        "Write a function to {i}.", "Can you write a function that {s}?",
        "Implement a function that {s}.", "How do I {i} in Python?",
        "Write a function `{name}` that {s}.", "I need a function that {s}."]
SYSTEMS = ["You are a helpful assistant.", "You are a coding assistant. Answer with Python code.",
           "You write short, correct Python functions."]


def third_person(verb: str) -> str:
    """'Return' -> 'returns', 'Match' -> 'matches', 'Copy' -> 'copies'."""
    v = verb.lower()
    if v.endswith(("s", "sh", "ch", "x", "z")):
        return v + "es"
    if v.endswith("y") and v[-2:-1] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def tasks_in(source: str):
    """(name, imperative summary, source) of each documented function of one file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        summary = (doc or "").strip().split("\n")[0].strip()
        m = SUMMARY.match(summary)
        if not m or not 3 <= len(summary.split()) <= 14 or m.group(1).endswith("s") \
                or m.group(1) in NOT_VERBS:
            continue  # "Returns ..." is a description, not an instruction
        seg = ast.get_source_segment(source, node)
        if seg is None or len(seg) > MAX_SOURCE_CHARS:
            continue
        code = textwrap.dedent(" " * node.col_offset + seg)
        yield node.name, summary.rstrip("."), code


@lru_cache(maxsize=None)
def tasks(split: str):
    """The split's tasks, cached as JSON next to it (parsing the corpus takes minutes here)."""
    cache = WORK / f"chat_tasks_{split}.json"
    if not cache.exists():
        text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
        cache.write_text(json.dumps([t for doc in text.split("\f") for t in tasks_in(doc)]))
    return [tuple(t) for t in json.loads(cache.read_text())]


def ask(name, summary, rng):
    verb, rest = summary.split(" ", 1)
    s = f"{third_person(verb)} {rest}"
    return rng.choice(ASKS).format(s=s, i=f"{verb.lower()} {rest}", name=name)


def answer(code: str) -> str:
    return f"```python\n{code}\n```"


@lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def piece_starts(ids: list[int], piece: list[int]) -> list[int]:
    """Where ``piece`` (token ids: a marker the demo's tokenizer spells in several) starts in ``ids``."""
    return [i for i in range(len(ids) - len(piece) + 1) if ids[i:i + len(piece)] == piece]


def render(messages, thinking: bool) -> str:
    return tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=thinking)


def example(split: str, index: int):
    """(prompt ids, answer ids) of example ``index`` of ``split``: seeded per index."""
    rng = random.Random(f"{SEED}-{split}-{index}")
    while True:
        prompt, reply = draw(tasks(split), rng)
        if len(prompt) + len(reply) <= MAX_TOKENS:
            return prompt, reply


DEF_LINE_SHARE = 0.0   # tune_tools.py --def-lines: the user turn is only the function's first line
THINK_SHARE = 0.15     # tune_tools.py --think-share: chat rows with thinking on
THOUGHTS = ""          # tune_tools.py --chat-thoughts: thinking-on rows write a thought before </think>
SHORT_THOUGHT = "The user wants a Python function. I will write it."


def thought(summary):
    """A one-line thought about a task (the task's summary, or with --chat-thoughts short one
    fixed sentence), then the closing tag."""
    if THOUGHTS == "short":
        return SHORT_THOUGHT + "\n</think>\n"
    verb, rest = summary.split(" ", 1)
    return f"The user asks for a function to {verb.lower()} {rest}.\n</think>\n"


def draw(pool, rng):
    name, summary, code = pool[rng.randrange(len(pool))]
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.2:   # an earlier exchange, as a second `chat` turn sends it
        n0, s0, c0 = pool[rng.randrange(len(pool))]
        messages += [{"role": "user", "content": ask(n0, s0, rng)},
                     {"role": "assistant", "content": answer(c0)}]
    bare = DEF_LINE_SHARE and rng.random() < DEF_LINE_SHARE   # as `generate -p "def f(x):"` sends it
    messages.append({"role": "user", "content": code.splitlines()[0] if bare else ask(name, summary, rng)})
    thinking = rng.random() < THINK_SHARE
    tok = tokenizer()
    prompt = tok.encode(render(messages, thinking), add_special_tokens=False)
    wrote = THOUGHTS == "short" or (THOUGHTS and not bare)
    opening = (thought(summary) if wrote else "</think>\n") if thinking else ""
    reply = opening + answer(code)
    return prompt, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]


if __name__ == "__main__":
    for split in ("train", "heldout"):
        print(split, len(tasks(split)), "tasks")
    p, a = example("train", 0)
    print(tokenizer().decode(p + a))
