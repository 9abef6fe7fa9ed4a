"""Chat-formatted tool use in Nemotron's format (issue 41), made offline and seeded per index.

Every example is a conversation rendered by transformers' ``apply_chat_template`` with the
shipped ``chat_template.jinja`` (tools in the system turn, calls as
``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``, tool
results as ``<tool_response>`` in a user turn), so the tokens are exactly the ones the server
sends. Three kinds of reply carry the loss:

  call:   tools offered, the user asks to read, list, run or write something: the reply is one
          call to the right tool with the argument the user named, then eos;
  result: the same conversation plus the call and the tool's result: the reply is a line or a
          short code block about the result, then eos;
  think:  a chat task (chat_data.py) with thinking on: a one-line thought, ``</think>``, the
          answer. Calls and results also come with thinking on, a quarter of the time.

Tool sets vary: the agents' own (Codex's ``shell`` / ``exec_command`` and ``apply_patch``,
Claude Code's ``Bash`` / ``Read`` / ``Write``, opencode's ``bash`` / ``read`` / ``list`` /
``write``) and generated ones, whose names, descriptions and parameter names are drawn from the
lists below. The held-out tool sets and requests (``testkit.demo_acts``: run from the checkout
with ``PYTHONPATH=.``) use
names, parameter names, descriptions and requests that no training example has
(``check_heldout`` asserts it when this module is run).
"""
import functools
import json
import random
import re

import chat_data
from testkit.demo_acts import HELDOUT_REQUESTS, HELDOUT_TOOLS, function

SEED = 4141
MAX_TOKENS = 640     # prompt + reply; longer draws are redrawn
THINK_SHARE = 0.25

# Generated tools: names made of a verb and a noun (so many that the model copies the name from
# the tools section rather than remembering it), descriptions and main parameter names per action.
VERBS = {"read": ["read", "view", "cat", "open", "get", "load", "fetch", "print", "peek"],
         "list": ["list", "ls", "dir", "scan", "glob", "enumerate", "index"],
         "run": ["run", "exec", "execute", "sh", "shell", "cmd", "bash", "spawn", "launch"],
         "write": ["write", "save", "create", "put", "store", "emit", "make"]}
NOUNS = {"read": ["file", "text", "contents", "doc", "page", "data"],
         "list": ["files", "dir", "directory", "folder", "entries", "tree"],
         "run": ["command", "terminal", "cmd", "process", "script", "task"],
         "write": ["file", "text", "contents", "doc", "output", "note"]}
DESCRIPTIONS = {
    "read": ["Read a file and return its contents.", "Return the text of a file.",
             "Print a file.", "Reads a file from the local filesystem.",
             "Get the contents of the file at a path."],
    "list": ["List the files in a directory.", "Return the names in a folder.",
             "List a directory's entries.", "Lists files and directories in a given path."],
    "run": ["Run a shell command and return its output.", "Execute a command in a terminal.",
            "Runs a bash command.", "Run a command and return stdout and stderr."],
    "write": ["Write text to a file.", "Create or overwrite a file with the given content.",
              "Save content to a file.", "Writes a file to the local filesystem."],
}
PARAMS = {
    "read": ["path", "file", "file_path", "filename", "filePath", "name", "fname", "src", "uri",
             "relative_path", "absolute_path", "file_name", "p"],
    "list": ["path", "dir", "directory", "folder", "dir_path", "root", "dirname", "base"],
    "run": ["command", "cmd", "script", "shell_command", "line", "cmdline", "argv_string", "code",
            "bash_command", "program"],
    "write": ["path", "file", "file_path", "filename", "filePath", "out", "out_path", "file_name"],
}
CONTENT_PARAMS = ["content", "text", "data", "contents", "body"]


# The agents' tools (schemas as the agents send them, descriptions shortened).
SHELL = function("shell", "Runs a shell command, and returns its output.",
                 [("command", "array", "The command to execute"),
                  ("workdir", "string", "The working directory for the command."),
                  ("timeout_ms", "number", "The timeout for the command in milliseconds.")])
EXEC = function("exec_command", "Runs a command in a PTY, returning output or a session ID.",
                [("cmd", "string", "Shell command to execute."),
                 ("workdir", "string", "Optional working directory to run the command in."),
                 ("yield_time_ms", "number", "How long to wait for output.")])
PATCH = function("apply_patch", "Use the `apply_patch` tool to edit files.",
                 [("input", "string", "The entire contents of the apply_patch command")])
BASH = function("Bash", "Executes a given bash command and returns its output.",
                [("command", "string", "The command to execute"),
                 ("description", "string", "Clear, concise description of what this command does"),
                 ("timeout", "number", "Optional timeout in milliseconds")])
READ = function("Read", "Reads a file from the local filesystem.",
                [("file_path", "string", "The absolute path to the file to read"),
                 ("offset", "number", "The line number to start reading from"),
                 ("limit", "number", "The number of lines to read")])
WRITE = function("Write", "Writes a file to the local filesystem.",
                 [("file_path", "string", "The absolute path to the file to write"),
                  ("content", "string", "The content to write to the file")],
                 ["file_path", "content"])
OC_BASH = function("bash", "Executes a given bash command in a persistent shell session.",
                   [("command", "string", "The command to execute"),
                    ("timeout", "number", "Optional timeout in milliseconds"),
                    ("description", "string", "Clear, concise description of what this command "
                                              "does in 5-10 words")])
OC_READ = function("read", "Reads a file from the local filesystem.",
                   [("filePath", "string", "The path to the file to read"),
                    ("offset", "number", "The line number to start reading from (0-based)"),
                    ("limit", "number", "The number of lines to read (defaults to 2000)")])
OC_LIST = function("list", "Lists files and directories in a given path.",
                   [("path", "string", "The absolute path to the directory to list")])
OC_WRITE = function("write", "Writes a file to the local filesystem.",
                    [("filePath", "string", "The absolute path to the file to write"),
                     ("content", "string", "The content to write to the file")],
                    ["filePath", "content"])
AGENT_SETS = [  # action -> tool; a missing action goes through the shell tool
    {"run": SHELL, "write": PATCH}, {"run": EXEC, "write": PATCH},
    {"run": BASH, "read": READ, "write": WRITE}, {"run": BASH, "read": READ},
    {"run": OC_BASH, "read": OC_READ, "list": OC_LIST, "write": OC_WRITE},
    {"run": OC_BASH, "read": OC_READ},
]

ASKS = {
    "read": ["Read the file {p}.", "Show me {p}.", "What is in {p}?", "Open {p}.",
             "Print the contents of {p}.", "Read {p} and tell me what it does.", "cat {p}",
             "Please read {p}.", "Look at {p}."],
    "list": ["List the files in {d}.", "What files are in {d}?", "Show the contents of the folder {d}.",
             "ls {d}", "Which files does {d} hold?", "List {d}."],
    "run": ["Run `{c}`.", "Run {c}", "Execute `{c}` and tell me the output.",
            "Please run the command `{c}`.", "Run the tests: `{c}`.", "Can you run `{c}`?"],
    "write": ["Write {t} to {p}.", "Create a file {p} containing {t}.", "Save {t} in {p}.",
              "Put {t} into {p}."],
}
HARD_ASKS = {  # more phrasings for the hard calls (none a held-out request's)
    "read": ASKS["read"] + ["Tell me what {p} says.", "Let me see {p}.", "Could you show me the file {p}?",
                            "What's inside {p}?", "Display {p}.", "Give me the text of {p}.",
                            "I want to see what {p} has.", "Can you open {p}?", "Load {p}.",
                            "Show the file {p}."],
    "list": ASKS["list"] + ["What is in the directory {d}?", "Show me the folder {d}.",
                            "Which files live in {d}?", "List the directory {d}.",
                            "What does the folder {d} have?", "Give me the file names in {d}."],
    "run": ASKS["run"] + ["Launch `{c}`.", "Run this: `{c}`", "Please execute `{c}`.", "Try `{c}`.",
                          "Kick off `{c}`.", "Use the shell to run `{c}`.", "Run the command {c} now."],
    "write": ASKS["write"] + ["Store {t} in the file {p}.", "Make {p} say {t}.", "Put the text {t} in {p}.",
                              "Fill {p} with {t}.", "Write the text {t} to the file {p}.",
                              "Save the words {t} into {p}."],
}
DIRS = ["src", "lib", "tests", "app", "docs", "scripts", "pkg", "tools", "examples", "utils",
        "core", "api", "bin", "data"]
WORDS = ["hello", "done", "TODO", "version 2", "ok", "print('hi')", "x = 1", "notes", "42", "draft"]
COMMANDS = ["pytest -q", "pytest tests/test_{m}.py", "python {f}", "git status",
            "git log --oneline -3", "make test", "python -m {m}", "ls -la", "npm test",
            "grep -n def {f}", "wc -l {f}", "python3 -m pip list", "git diff", "cargo build",
            "python -m unittest", "echo hi", "pwd", "head {f}", "uname -a", "date"]


def files(split):
    """Bare module names and short paths made from the split's stdlib file names."""
    names = json.loads((chat_data.WORK / f"{split}_files.json").read_text())
    return sorted({n for n in names if "/" not in n} | {"/".join(n.split("/")[-2:]) for n in names})


SYLLABLES = ["ka", "lo", "mir", "te", "zu", "pan", "dro", "vi", "sel", "qua", "bo", "rin", "ex", "tal"]
RANDOM_NAMES = False    # tune_tools.py --random-names: generated tools get meaningless names


def tool_name(action, rng):
    if RANDOM_NAMES:   # nothing to remember: the name can only be copied from the tools section
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))) + rng.choice(["", "_x", "2"])
    verb, noun = rng.choice(VERBS[action]), rng.choice(NOUNS[action])
    form = rng.randrange(4)
    return [verb, f"{verb}_{noun}", f"{verb}{noun.title()}", f"{noun}_{verb}"][form]


def make_tool(action, rng):
    name = tool_name(action, rng)
    params = [(rng.choice(PARAMS[action]), "string", "The " + {"read": "file to read", "list": "directory",
                                                              "run": "command", "write": "file"}[action])]
    if action == "write":
        params.append((rng.choice(CONTENT_PARAMS), "string", "The text to write"))
    return function(name, rng.choice(DESCRIPTIONS[action]), params,
                    [p[0] for p in params])


def tool_set(rng):
    """action -> tool: an agent's set, or a generated one (run, plus some of read/list/write)."""
    if rng.random() < 0.45:
        return dict(rng.choice(AGENT_SETS))
    actions = ["run"] if rng.random() < 0.8 else []
    actions += [a for a in ("read", "list", "write") if rng.random() < 0.6]
    tools, names = {}, set()
    for a in actions or ["read"]:
        t = make_tool(a, rng)
        if t["function"]["name"] not in names:
            tools[a], names = t, names | {t["function"]["name"]}
    return tools


def request(action, rng, paths, asks=ASKS):
    """(user turn, the argument the call must carry, the text to write)."""
    p = rng.choice(paths)
    if action == "read":
        return rng.choice(asks["read"]).format(p=p), p, ""
    if action == "list":
        d = rng.choice(DIRS + [x.rsplit("/", 1)[0] for x in paths[:50] if "/" in x])
        return rng.choice(asks["list"]).format(d=d), d, ""
    if action == "run":
        c = rng.choice(COMMANDS).format(m=p.split("/")[-1].removesuffix(".py"), f=p)
        return rng.choice(asks["run"]).format(c=c), c, ""
    t = rng.choice(WORDS)
    return rng.choice(asks["write"]).format(p=p, t=t), p, t


def arguments(tool, action, arg, content):
    """The call's arguments: the main parameter (an array command for Codex's shell, a patch for
    apply_patch, a shell command for a missing read or list tool), and the content to write."""
    props = list(tool["function"]["parameters"]["properties"].items())
    key, spec = props[0]
    name = tool["function"]["name"]
    if name == "apply_patch":
        return {key: f"*** Begin Patch\n*** Add File: {arg}\n+{content}\n*** End Patch"}
    if action in ("read", "list") and tool.get("_shell"):
        arg = ("cat " if action == "read" else "ls ") + arg
    value = ["bash", "-lc", arg] if spec["type"] == "array" else arg
    out = {key: value}
    if action == "write":
        out[props[1][0]] = content
    return out


def pick(tools, action):
    """The tool for an action; read and list fall back to the shell tool (flagged)."""
    if action in tools:
        return tools[action]
    if action in ("read", "list") and "run" in tools:
        return {**tools["run"], "_shell": True}
    return None


def call_text(name, args):
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def result_and_answer(action, arg, content, rng, split):
    """A plausible tool output and a reply of a line or a short code block."""
    if action == "read":
        name, _, code = rng.choice(chat_data.tasks(split))
        lines = code.splitlines()
        head = "\n".join(lines[:rng.randint(1, 3)])
        return code, rng.choice([f"`{arg}` defines `{name}`.",
                                 f"`{arg}` starts with:\n```python\n{head}\n```",
                                 f"It holds the function `{name}`."])
    if action == "list":
        entries = rng.sample(files(split), rng.randint(2, 5))
        entries = [e.split("/")[-1] for e in entries]
        listing = ", ".join(f"`{e}`" for e in entries)
        return "\n".join(entries), rng.choice([f"`{arg}` holds {listing}.", f"The files are {listing}."])
    if action == "run":
        out = rng.choice([f"{rng.randint(1, 40)} passed in 0.{rng.randint(10, 99)}s",
                          "On branch main\nnothing to commit, working tree clean",
                          f"{rng.randint(1, 999)} {arg.split()[-1]}", "hi", "ok",
                          f"Traceback (most recent call last):\nNameError: name 'x' is not defined",
                          "/home/user/project", "Build finished."])
        last = out.splitlines()[-1]
        return out, rng.choice([f"It printed `{last}`.", f"The command finished:\n```\n{out}\n```",
                                f"Done: `{last}`."])
    return f"Wrote {len(content)} bytes to {arg}", rng.choice(
        [f"Wrote `{arg}`.", f"Done: `{arg}` now holds {content}.", f"Saved `{arg}`."])


def thought(action, arg, name):
    verb = {"read": "read", "list": "list", "run": "run", "write": "write"}[action]
    if chat_data.THOUGHTS == "short":   # the tool's name is left to the call
        return f"The user wants me to {verb} {arg}."
    return f"The user wants me to {verb} {arg}. I will call {name}."


def conversation(split, rng):
    """(messages, tools, action, arg, the call's name and arguments, content)."""
    tools = tool_set(rng)
    action = rng.choice([a for a in ("read", "list", "run", "write") if pick(tools, a)])
    ask, arg, content = request(action, rng, files(split))
    tool = pick(tools, action)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(chat_data.SYSTEMS)})
    messages.append({"role": "user", "content": ask})
    listed = [{k: v for k, v in t.items() if k != "_shell"} for t in tools.values()]
    rng.shuffle(listed)
    return messages, listed, action, arg, tool["function"]["name"], arguments(tool, action, arg, content), content


def render(messages, tools, thinking):
    return chat_data.tokenizer().apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)


KIND_WEIGHTS = [0.45, 0.35, 0.2]   # call, result, think (tune_tools.py --kinds)


def draw(split, rng):
    kind = rng.choices(["call", "result", "think"], KIND_WEIGHTS)[0]
    tok = chat_data.tokenizer()
    if kind == "think":
        name, summary, code = rng.choice(chat_data.tasks(split))
        ask = chat_data.ask(name, summary, rng)
        prompt = chat_data.render([{"role": "user", "content": ask}], True)
        reply = chat_data.thought(summary) + chat_data.answer(code)
    else:
        messages, tools, action, arg, name, args, content = conversation(split, rng)
        thinking = rng.random() < THINK_SHARE
        if kind == "call":
            reply = call_text(name, args)
            if thinking:
                reply = thought(action, arg, name) + "\n</think>\n" + reply
        else:
            out, reply = result_and_answer(action, arg, content, rng, split)
            messages += [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
                         {"role": "tool", "content": out}]
            if thinking:
                reply = "I have the result.\n</think>\n" + reply
        prompt = render(messages, tools, thinking)
    return tok.encode(prompt, add_special_tokens=False), tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]


def example(split: str, index: int):
    """(prompt ids, reply ids) of example ``index`` of ``split``: seeded per index."""
    rng = random.Random(f"{SEED}-{split}-{index}")
    while True:
        prompt, reply = draw(split, rng)
        if len(prompt) + len(reply) <= MAX_TOKENS:
            return prompt, reply


# Hard call examples (tune_tools.py --hard): 2-4 generated tools of different actions, named at
# random (syllables, two unrelated words, or a verb-noun composition), so the tool can only be
# chosen by its description and its name only copied from the tools section.
HARD_DESCRIPTIONS = {
    "read": ["Show the text of a file.", "Return what a file contains.", "Open a file and print it.",
             "Give back the lines of a file.", "Fetch a file's text.", "Display a file.",
             "Read the whole file at a path.", "Get a file's contents as a string."],
    "list": ["Show the entries of a folder.", "List what a directory contains.",
             "Return the file names in a folder.", "Enumerate a directory.",
             "Show the files inside a folder.", "Give the names found in a directory."],
    "run": ["Run a program in the terminal.", "Execute a shell command.",
            "Run a command line and return what it prints.", "Start a command and return its output.",
            "Run something in a terminal session.", "Execute a program with the shell."],
    "write": ["Write text into a file.", "Store text in a file.", "Save a string to a file.",
              "Put content in a file on disk.", "Create a file holding some text.",
              "Overwrite a file with new text."],
}
HARD_PARAM_DESC = {"read": ["Which file to read", "The path", "File to open"],
                   "list": ["Which directory", "The folder", "Directory to list"],
                   "run": ["The command line", "What to run", "Command text"],
                   "write": ["The path to write", "Output file", "File to create"]}
EXTRA_PARAMS = ["spec", "arg", "value", "input", "query", "loc", "which", "item", "subject",
                "resource", "pathname", "cmd_text", "shellcmd", "entry", "object", "ref", "line_text"]
WORDS_A = ["amber", "nimbus", "falcon", "tulip", "quartz", "pebble", "cobalt", "mango", "orbit",
           "lumen", "fjord", "cinder", "velvet", "walrus", "zephyr", "gadget", "marble", "sprout",
           "rocket", "bramble", "kettle", "maple", "pixel", "raven", "thistle", "yonder"]


VOCAB_NAMES = False   # tune_tools.py --vocab-names: most hard names made of random vocabulary pieces


@functools.lru_cache(maxsize=None)
def vocab_pieces():
    """Lowercase alphabetic pieces of the tokenizer's vocabulary (2-6 letters)."""
    tok = chat_data.tokenizer()
    return sorted(p for p in tok.get_vocab() if p.isascii() and p.isalpha() and p.islower() and 2 <= len(p) <= 6)


def hard_name(action, rng):
    form = rng.random()
    if VOCAB_NAMES:
        held = {t["function"]["name"] for ts in HELDOUT_TOOLS for t in ts}
        while form < 0.5:
            pieces = vocab_pieces()
            name = rng.choice(pieces) + rng.choice(["", "_"]) + rng.choice(pieces)
            if rng.random() < 0.5:
                name = rng.choice(pieces) + rng.choice(["", "_"]) + rng.choice(pieces[:400] + [""])
            if name not in held:
                return name
        form = (form - 0.5) * 1.4      # then syllables or two words
    if form < 0.4:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))) + rng.choice(["", "_x", "2"])
    if form < 0.7 or VOCAB_NAMES:
        return rng.choice(WORDS_A) + rng.choice(["_", ""]) + rng.choice(WORDS_A)
    verb, noun = rng.choice(VERBS[action]), rng.choice(NOUNS[action])
    return rng.choice([verb, f"{verb}_{noun}", f"{verb}{noun.title()}", f"{noun}_{verb}"])


# Composed descriptions (choice_probe.py --composed): a verb and an object drawn apart, so a
# description is recognised by its words (file, folder, shell, write ...), not remembered whole.
COMPOSED_VERBS = {"read": ["Show", "Return", "Print", "Display", "Fetch", "Get", "Read", "Open",
                           "Output", "Give back", "Dump out"],
                  "list": ["Show", "List", "Return", "Give", "Enumerate", "Display", "Print", "Scan"],
                  "run": ["Run", "Execute", "Launch", "Spawn", "Fire off", "Kick off"],
                  "write": ["Write", "Save", "Store", "Place", "Create", "Overwrite", "Record"]}
COMPOSED_OBJECTS = {
    "read": ["the text of a file", "what a file contains", "a file's contents", "the lines of a file",
             "a file as a string", "the contents of a file on disk", "the source of a file",
             "what is in a file", "a text file"],
    "list": ["the entries of a folder", "the files in a directory", "what a folder contains",
             "the names in a directory", "a folder's files", "the contents of a directory",
             "what is in a folder", "the children of a directory"],
    "run": ["a shell command", "a program in the terminal", "a command line", "a command in a shell",
            "a process", "a script in the terminal", "a terminal command", "a bash line"],
    "write": ["text into a file", "a string in a file", "content to a file", "text to a file on disk",
              "a file with some text", "new text in a file", "words into a file"]}
COMPOSED_TAILS = {"read": ["", " at a path", " from disk"], "list": ["", " at a path", " on disk"],
                  "run": ["", " and return its output", " and return what it prints"],
                  "write": ["", " at a path", " on disk"]}
COMPOSED_PARAM_DESC = {"read": ["Which file", "The file to show", "Path of the file", "File path"],
                       "list": ["Which directory", "The folder to list", "Folder path", "Directory"],
                       "run": ["The command", "Command to run", "What to execute", "Shell line"],
                       "write": ["Which file", "Target file", "File to write", "Output path"]}
COMPOSED_DESCRIPTIONS = False
HELDOUT_DESCRIPTIONS = {t["function"]["description"] for ts in HELDOUT_TOOLS for t in ts}


def hard_call_options(vocab_names=False, composed=False):
    """The probes' hard calls: random names (vocabulary pieces for half with ``vocab_names``) and,
    with ``composed``, composed descriptions."""
    global RANDOM_NAMES, VOCAB_NAMES, COMPOSED_DESCRIPTIONS
    RANDOM_NAMES, VOCAB_NAMES, COMPOSED_DESCRIPTIONS = True, vocab_names, composed


def hard_description(action, rng):
    if COMPOSED_DESCRIPTIONS and rng.random() < 0.7:
        while True:
            d = (f"{rng.choice(COMPOSED_VERBS[action])} {rng.choice(COMPOSED_OBJECTS[action])}"
                 f"{rng.choice(COMPOSED_TAILS[action])}.")
            if d not in HELDOUT_DESCRIPTIONS:
                return d
    return rng.choice(HARD_DESCRIPTIONS[action] + DESCRIPTIONS[action])


def hard_tool(action, rng):
    key = rng.choice(PARAMS[action] + EXTRA_PARAMS if rng.random() < 0.5 else EXTRA_PARAMS)
    descs = HARD_PARAM_DESC[action] + (COMPOSED_PARAM_DESC[action] if COMPOSED_DESCRIPTIONS else [])
    params = [(key, "string", rng.choice(descs))]
    if action == "write":
        params.append((rng.choice([c for c in CONTENT_PARAMS if c != key]), "string", "The text to write"))
    return function(hard_name(action, rng), hard_description(action, rng), params, [p[0] for p in params])


HARD_SIZES = [2, 2, 3, 4]   # tools per hard set (tune_tools.py --two-tools: [2])


def hard_tools(actions, rng) -> dict:
    """A hard tool per action, no two of the same name."""
    tools, names = {}, set()
    for a in actions:
        t = hard_tool(a, rng)
        while t["function"]["name"] in names:
            t = hard_tool(a, rng)
        tools[a], names = t, names | {t["function"]["name"]}
    return tools


def hard_conversation(split, rng):
    actions = rng.sample(["read", "list", "run", "write"], rng.choice(HARD_SIZES))
    tools = hard_tools(actions, rng)
    action = rng.choice(actions)
    ask, arg, content = request(action, rng, files(split), HARD_ASKS)
    tool = tools[action]
    listed = list(tools.values())
    rng.shuffle(listed)
    return ([{"role": "user", "content": ask}], listed, action, arg, tool["function"]["name"],
            arguments(tool, action, arg, content), content)


def hard_example(split, index):
    """(prompt ids, reply ids) of a hard call (thinking on a quarter of the time)."""
    rng = random.Random(f"{SEED}-hard-{split}-{index}")
    tok = chat_data.tokenizer()
    while True:
        messages, tools, action, arg, name, args, content = hard_conversation(split, rng)
        thinking = rng.random() < THINK_SHARE
        reply = call_text(name, args)
        if thinking:
            reply = thought(action, arg, name) + "\n</think>\n" + reply
        p = tok.encode(render(messages, tools, thinking), add_special_tokens=False)
        r = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        if len(p) + len(r) <= MAX_TOKENS:
            return p, r


MULTI_MAX_TOKENS = 900


def hard_multi_example(split, index):
    """A conversation of 2-3 requests for different actions on one hard tool set (4 tools a third
    of the time, else 3 or 2 tools), each answered by a call, the tool's result and a short answer;
    it ends after the last call and eos. (ids, labels): labels are -100 except on every call and
    every answer (so one sequence carries a tool choice per request)."""
    rng = random.Random(f"{SEED}-multi-{split}-{index}")
    tok = chat_data.tokenizer()
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    while True:
        k = rng.choice([2, 3, 3, 4] if HARD_SIZES != [2] else [2])
        actions = rng.sample(["read", "list", "run", "write"], k)
        tools = hard_tools(actions, rng)
        listed = list(tools.values())
        rng.shuffle(listed)
        turns = rng.sample(actions, min(k, rng.choice([2, 3])))
        messages, ids, labels, text = [], [], [], ""
        for n, action in enumerate(turns):
            ask, arg, content = request(action, rng, files(split), HARD_ASKS)
            tool = tools[action]
            args = arguments(tool, action, arg, content)
            name = tool["function"]["name"]
            messages.append({"role": "user", "content": ask})
            prompt = render(messages, listed, False)
            assert prompt.startswith(text)
            new = enc(prompt[len(text):])
            call = call_text(name, args)
            ids += new
            labels += [-100] * len(new)
            last = n == len(turns) - 1
            c = enc(call) + ([tok.eos_token_id] if last else [])
            ids += c
            labels += c
            text = prompt + call
            if last:
                break
            out, answer = result_and_answer(action, arg, content, rng, split)
            out = "\n".join(out.splitlines()[:6])
            messages += [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
                         {"role": "tool", "content": out}]
            prompt = render(messages, listed, False)
            assert prompt.startswith(text), (prompt[len(text) - 50:len(text) + 50], text[-50:])
            new = enc(prompt[len(text):])
            ids += new
            labels += [-100] * len(new)
            a = enc(answer)
            ids += a
            labels += a
            text = prompt + answer
            messages.append({"role": "assistant", "content": answer})
        if len(ids) <= MULTI_MAX_TOKENS:
            return ids, labels


def probe_example(index):
    """A hard call on the held-out files, thinking off: (prompt ids, reply ids without eos,
    the tool's name, its main argument as the call writes it, the offered names)."""
    rng = random.Random(f"{SEED}-probe-{index}")
    tok = chat_data.tokenizer()
    while True:
        messages, tools, action, arg, name, args, content = hard_conversation("heldout", rng)
        value = next(iter(args.values()))
        p = tok.encode(render(messages, tools, False), add_special_tokens=False)
        if len(p) <= MAX_TOKENS:
            return (p, tok.encode(call_text(name, args), add_special_tokens=False), name, value,
                    [t["function"]["name"] for t in tools])


def check_heldout():
    """No held-out tool name or parameter name is a training one, no held-out request a
    training phrasing."""
    train_names = {t["function"]["name"] for s in AGENT_SETS for t in s.values()} | {
        name for a in VERBS for v in VERBS[a] for n in NOUNS[a]
        for name in (v, f"{v}_{n}", f"{v}{n.title()}", f"{n}_{v}")}
    train_names |= set(WORDS_A)
    train_params = {p for ps in PARAMS.values() for p in ps} | set(CONTENT_PARAMS) | set(EXTRA_PARAMS)
    train_descriptions = {d for ds in list(DESCRIPTIONS.values()) + list(HARD_DESCRIPTIONS.values()) for d in ds}
    for tools in HELDOUT_TOOLS:
        for t in tools:
            assert t["function"]["name"] not in train_names, t["function"]["name"]
            assert not set(t["function"]["parameters"]["properties"]) & train_params, t
            assert t["function"]["description"] not in train_descriptions, t
    patterns = phrasings()
    for _, ask, *_ in HELDOUT_REQUESTS:
        assert not any(re.fullmatch(p, ask) for p in patterns), ask


def phrasings(asks=None):
    """Every training request phrasing (HARD_ASKS holds ASKS) as a regex, a slot matching any
    text."""
    return [".+".join(re.escape(part) for part in re.split(r"\{\w\}", a))
            for group in (asks or HARD_ASKS).values() for a in group]


def show(draws):
    """Print (prompt, reply) pairs: each prompt's end, then its reply in bold."""
    tok = chat_data.tokenizer()
    for p, a in draws:
        print(f"--- {len(p)} + {len(a)} tokens\n{tok.decode(p[-200:])}\x1b[1m{tok.decode(a)}\x1b[0m")

if __name__ == "__main__":
    check_heldout()
    show(example("train", i) for i in range(6))
