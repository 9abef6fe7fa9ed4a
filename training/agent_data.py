"""Agent turns for the tool tune (issue 41, item 4): what Codex and opencode send on a
tool-using turn, recorded whole (``testkit/agents/``), with the user's request, the working
folder, the call and the tool's output swapped (``testkit/agent_turns.py``), rendered as
``mlx-dspark serve`` renders them (its own protocol readers and ``chat_ids``). So the tune
sees the prompt an agent's request becomes, 9,000-10,000 tokens of instructions and tool
definitions before the request, and learns the agent's own tools: Codex runs everything
through ``exec_command``; opencode runs and lists through ``bash`` and reads with ``read``.

A **call** row ends with the call and eos; a **result** row holds the call and its output and
ends with a line of answer and eos (tool_data.result_and_answer). Seeded per index, as
tool_data.example; the phrasings are tool_data's (none is one of agent_turns.AGENT_REQUESTS,
tool_data.check_heldout)."""

from __future__ import annotations

import functools
import random

import chat_data
import tool_data
from testkit import agent_turns

SEED = 5151
MADE_UP_FILES = 0.0   # tune_tools.py --made-up-files: share of turns naming made-up files or commands
MIRROR_NAMES = False  # tune_tools.py --mirror-names: calls spell a name in the request's pieces (mirrored)
EXTENSIONS = [".py", ".md", ".txt", ".json", ".toml", ".cfg", ".yaml", ".sh", ".ini", ""]
# One fixed sentence: thoughts that named the argument ("The user wants me to read parser.py.")
# ran on into a list of it wherever the copy failed (ah_e, ah_g: training/README.md step 3d).
AGENT_THOUGHT = "The user wants me to use a tool."
THINK_SHARE = 0.25   # turns asked with thinking on (the agents ask none; Claude Code and the checks do)
ACTIONS = ("run", "list", "read")
HERE_ASKS = ["List the files here.", "What files are in this folder?", "ls",
             "Show me what is in this directory.", "Which files are here?", "List this folder."]
USERS = ["alice", "bob", "dev", "sam", "kim", "user", "lee", "max"]
PROJECTS = ["app", "demo", "parser", "site", "tool", "api", "notes", "game", "lib", "work"]


@functools.cache
def _runtime():
    from mlx_dspark.text.tokenizer import load_tokenizer

    return load_tokenizer(chat_data.DEMO)


def render(agent: str, body: dict) -> list[int]:
    """The prompt ids ``serve`` makes of ``body`` (its reader for the agent's route, then
    chat_ids), with the server's defaults."""
    from mlx_dspark.serve import openai, responses
    from mlx_dspark.serve.asked import Defaults
    from mlx_dspark.text.tokenizer import chat_ids

    tok = _runtime()
    if agent_turns.recorded(agent)["route"] == "/v1/responses":
        asked = responses.read(body, Defaults())
    else:
        asked = openai.read(body, "chat", Defaults(), len(tok.get_vocab()))
    return chat_ids(tok, asked.prompt, asked.template, asked.use, asked.prefill)


def _request(rng, split):
    """(user turn, action, argument) for one agent turn; a listing of the folder itself has
    no argument."""
    action = rng.choice(ACTIONS)
    if action == "list" and rng.random() < 0.4:
        return rng.choice(HERE_ASKS), action, ""
    if rng.random() < MADE_UP_FILES:
        if action == "run":
            c = made_up_command(rng)
            return rng.choice(tool_data.HARD_ASKS["run"]).format(c=c), action, c
        paths = [made_up_path(rng) for _ in range(8)]
    else:
        paths = tool_data.files(split)
    ask, arg, _ = tool_data.request(action, rng, paths, tool_data.HARD_ASKS)
    return ask, action, arg


@functools.cache
def _pieces() -> list[str]:
    """The tokenizer's pieces of 2-8 letters (2,206 of its 4,096)."""
    import re

    return sorted(t for t in chat_data.tokenizer().get_vocab() if re.fullmatch(r"[A-Za-z]{2,8}", t))


def made_up_path(rng) -> str:
    """A file name no corpus holds (1-3 of the tokenizer's letter pieces, an extension,
    sometimes in a folder), so that the argument can only be copied from the request, and the
    copy is learnt for every piece, not for a few remembered names."""
    name = "".join(rng.choice(_pieces()) for _ in range(rng.randint(1, 3))) + rng.choice(EXTENSIONS)
    return f"{rng.choice(tool_data.DIRS)}/{name}" if rng.random() < 0.3 else name


def made_up_command(rng) -> str:
    """A command line of made-up words and flags, for the same reason."""
    words = [rng.choice(_pieces()).lower() for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.5:
        words.insert(1, "-" + rng.choice("abcdefghijklmnopqrstuvwxyz" + "-v"))
    return " ".join(words)


def folder(seed) -> str:
    """The agent's working folder, drawn for ``seed``."""
    rng = random.Random(f"{SEED}-cwd-{seed}")
    return f"/home/{rng.choice(USERS)}/{rng.choice(PROJECTS)}"


def example(split: str, index: int, cwd: str | None = None, kind: str | None = None):
    """(prompt ids, reply ids) of agent turn ``index`` of ``split``: a call or the answer
    after its result, the agent and the kind alternating unless ``kind`` is given. ``cwd``: the
    agent's folder (by default one drawn for the turn); rows that share it share the prompt up
    to the user's request (agent_loss runs that prefix once)."""
    rng = random.Random(f"{SEED}-{split}-{index}")
    agent = agent_turns.AGENTS[index % 2]
    kind = kind or ("call", "result")[(index // 2) % 2]
    ask, action, arg = _request(rng, split)
    cwd = cwd or folder(f"{split}-{index}")
    name, args = agent_turns.call(agent, action, arg)
    tok = chat_data.tokenizer()
    thinking = random.Random(f"{SEED}-think-{split}-{index}").random() < THINK_SHARE
    if kind == "call":
        body = agent_turns.body_of(agent, ask, cwd)
        reply = tool_data.call_text(name, args)
        opening = AGENT_THOUGHT
    else:
        out, reply = tool_data.result_and_answer(action, arg, "", rng, split)
        if not arg:
            reply = "The files here are " + ", ".join(f"`{x}`" for x in out.splitlines()) + "."
        result = agent_turns.framed(agent, name, out, cwd, arg, rng)
        body = agent_turns.body_of(agent, ask, cwd, (name, args), result)
        opening = "I have the result."
    if thinking:
        reply = opening + "\n</think>\n" + reply
        body = think_on(agent, body)
    prompt = render(agent, body)
    ids = tok.encode(reply, add_special_tokens=False)
    if MIRROR_NAMES and kind == "call":
        ids = mirrored(reply, args, prompt)
    return prompt, ids + [tok.eos_token_id]


def mirrored(reply: str, args: dict, prompt: list[int]) -> list[int]:
    """``reply``'s ids with each argument value that opens its line spelt in the pieces the
    request spells it in, less the first piece's leading space: opencode's ``filePath`` setup.py
    is ``setup .py`` on its own, but ``▁set up .py`` in "What does setup.py contain?", so the
    model has a piece to copy (``set`` for ``▁set``) instead of one to guess. The text, and so
    the call the server parses, is the same."""
    tok = chat_data.tokenizer()
    vocab = tok.get_vocab()
    last = prompt[last_turn_start(prompt):]
    out, rest = [], reply
    for v in (v for v in args.values() if isinstance(v, str) and f">\n{v}\n" in rest):
        spaced = tok.encode(" " + v, add_special_tokens=False)
        first = tok.convert_ids_to_tokens(spaced[0])
        held = any(last[i:i + len(spaced)] == spaced for i in range(len(last)))
        if not (held and first.startswith("▁") and first[1:] in vocab):
            continue
        before, rest = rest.split(f">\n{v}\n", 1)
        out += tok.encode(before + ">\n", add_special_tokens=False) + [vocab[first[1:]]] + spaced[1:]
        rest = "\n" + rest
    ids = out + tok.encode(rest, add_special_tokens=False)
    assert tok.decode(ids) == reply, (tok.decode(ids), reply)
    return ids


def last_turn_start(prompt: list[int]) -> int:
    """Where the prompt's last turn (the user's request) starts: its last ``<|im_start|>`` but
    the reply's own, which the demo's tokenizer spells in 7 pieces."""
    mark = chat_data.tokenizer().encode("<|im_start|>", add_special_tokens=False)
    return chat_data.piece_starts(prompt, mark)[-2]


def shared_prefix(prompts) -> int:
    """How many leading tokens all ``prompts`` share, leaving at least one token of each."""
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = next((j for j in range(n) if p[j] != prompts[0][j]), n)
    return n


def think_on(agent: str, body: dict) -> dict:
    """``body`` with thinking asked for, as a client asks it (a low effort: a short budget)."""
    if agent == "codex":
        return {**body, "reasoning": {**body.get("reasoning", {}), "effort": "low"}}
    return {**body, "reasoning_effort": "low"}


def check_heldout():
    """No held-out agent request (agent_turns.AGENT_REQUESTS) is a training phrasing."""
    import re

    patterns = tool_data.phrasings(tool_data.HARD_ASKS) + [re.escape(a) for a in HERE_ASKS]
    for _, ask, *_ in agent_turns.AGENT_REQUESTS:
        assert not any(re.fullmatch(p, ask) for p in patterns), ask


if __name__ == "__main__":
    check_heldout()
    tool_data.show(example("train", i) for i in range(4))
