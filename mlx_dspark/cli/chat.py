"""``mlx-dspark chat``: an interactive chat in the terminal.

A turn's prompt is the previous turns' ids exactly as the model saw and produced them, then
what the chat template writes after the last answer (:class:`Conversation`). So the prompt
extends what the session holds and only the new tokens are prefilled: the target cache and
the drafter context carry over between turns (llama.cpp and mlx-lm keep their caches the same
way). A template that rewrites past answers (some drop past reasoning) would want different
history tokens; the model sees its own tokens instead, as it did when it wrote them.

Ctrl-C during an answer stops it at the next token and keeps the conversation: the SIGINT
handler only sets a flag, so no model call is torn in half. Ctrl-C while a long message is
prefilled (its progress shown on stderr) stops it before the next piece and drops the
message: the session goes back to the conversation as it was.

``/save NAME`` writes the conversation and the session's state to the prompt cache directory
(``named/NAME``); ``/load NAME`` and ``--resume NAME`` bring both back after a restart, so
the next turn prefills only its own tokens (docs/prompt-cache.md)."""

from __future__ import annotations

import sys

from .. import api
from ..decode.pieces import ends as piece_ends
from ..decode.session import Session
from ..request import SEEDS
from ..stats import Stats, format_line, format_stats
from ..text.tokenizer import _encode, message_boundaries, prompt_ids, template_options
from .common import (CatchInterrupt, CommandError, PrefillMeter, flag_error, request_options,
                     utf8_text)
from .interrupted import carry_on

HELP = """Type a message and press Enter; a message in triple quotes (\"\"\") may span lines.
commands:
  /reset   forget the conversation (the next prompt is prefilled from scratch)
  /stats   statistics of the conversation so far
  /think on|off   let the model think before it answers, or not (templates with the switch)
  /save NAME  keep the conversation and its state on disk (--prompt-cache-dir)
  /load NAME  continue a saved conversation (so does --resume NAME)
  /help    this list
  /quit    leave (so do q, quit, exit, /exit and Ctrl-D)
Ctrl-C stops the current answer and keeps the conversation (during a long message's prefill:
drops the message)."""


# What leaves the chat as a whole message, as in mlx_lm.chat (its "q"), besides /quit.
QUIT = ("q", "quit", "exit")
DIM, PLAIN = "\x1b[2m", "\x1b[0m"     # how thinking is shown on a terminal
# Bracketed paste: a terminal in this mode sends pasted text between these marks, so a pasted
# block of lines is one message. GNU readline reads the marks itself; without it (libedit,
# no readline) they reach the line read, and _read_message joins the lines between them.
PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


class Conversation:
    """The messages so far, and the ids the model has seen and said for them."""

    # stands for the last answer while the template renders what follows it
    ANSWER = "\x00mlx-dspark answer\x00"

    def __init__(self, tokenizer, options: dict, system: str | None = None):
        self.tokenizer, self.options, self.system = tokenizer, options, system
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids: list[int] = []

    def prompt(self, user: str) -> list[int]:
        """Ids of the conversation plus a new user message, ready for the reply: the previous
        ids, then what the template writes after the last answer (its end-of-turn marker, the
        new message, the reply header)."""
        new = {"role": "user", "content": user}
        if self.ids:
            probe = self.messages[:-1] + [dict(self.messages[-1], content=self.ANSWER), new]
            text = self._render(probe)
            at = text.rfind(self.ANSWER)
            if at >= 0:
                return self.ids + _encode(self.tokenizer, text[at + len(self.ANSWER):])
        return prompt_ids(self.tokenizer, self.messages + [new], True, self.options)

    def _render(self, messages) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **self.options)

    def add_turn(self, user: str, prompt: list[int], answer_ids: list[int], answer_text: str):
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": answer_text}]
        self.ids = prompt + answer_ids


class Chat:
    def __init__(self, pair, args):
        self.pair, self.args = pair, args
        # its prompts always extend what it holds (Conversation): no state kept besides
        self.session = Session(pair.target, pair.drafter, home=pair)
        self.conversation = Conversation(pair.tokenizer,
                                         template_options(pair.tokenizer, args.reasoning,
                                                          args.chat_template_args),
                                         args.system_prompt)
        self.turns: list[Stats] = []   # final stats of each answer since the last /reset
        self._store = None

    def store(self):
        """The prompt cache directory's store (--prompt-cache-dir, else the default)."""
        if self._store is None:
            if self.pair.prompt_cache is not None:
                self._store = self.pair.prompt_cache.store
            else:
                from ..prompt_cache.disk import open_store
                self._store = open_store(self.args.prompt_cache_dir or default_prompt_dir(),
                                         self.pair, self.pair.drafter is not None,
                                         int(self.args.prompt_cache_disk_gb * 1e9))
        return self._store

    def save(self, name: str):
        snap = self.session.snapshot()
        path = self.store().save_named(name, snap, {"messages": self.conversation.messages,
                                                    "ids": self.conversation.ids})
        print(f"(saved {len(snap.tokens)} tokens of state to {path})")

    def load(self, name: str, how: str = "/load", otherwise: str = "the conversation goes "
             "on as it was"):
        """Continue the conversation saved as ``name``. One that cannot be continued (an
        unusable file, another pair's state) is one warning, and nothing changes: the next
        turn is prefilled as it would have been. A name never saved is an UnknownName."""
        from ..prompt_cache.disk import UnknownName
        store = self.store()        # an unusable directory is an error, not a warning
        try:
            snap, extra = store.load_named(name)
            messages, ids = _saved_conversation(snap, extra)
            self.session.restore(snap)      # refuses before it changes anything
        except UnknownName:
            raise
        except (ValueError, OSError) as e:  # SnapshotError is a ValueError
            print(f"warning: {how} {name} ({store.named_path(name)}): {e}; {otherwise}",
                  file=sys.stderr)
            return
        self.conversation.messages, self.conversation.ids = messages, ids
        self.turns = []
        print(f"(continuing {name!r}: {len(messages)} messages, {len(ids)} tokens, none "
              f"prefilled again)")

    def run(self) -> int:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        model = self.args.model or "the embedded demo pair (a demonstration model, not Nemotron)"
        drafter = self.pair.drafter_note or ("no drafter" if self.pair.drafter is None
                                             else "DSpark drafter")
        print(f"mlx-dspark chat: {model}, {drafter}, speculative {self.args.speculative}. "
              f"/help lists the commands, q or Ctrl-D exits.")
        if hasattr(sys.stdin, "reconfigure"):    # bytes that are not UTF-8 reach utf8_text
            sys.stdin.reconfigure(errors="surrogateescape")
        paste = sys.stdin.isatty() and sys.stdout.isatty()
        if paste:
            _write(PASTE_ON)
        try:
            return self._run()
        finally:
            if paste:
                _write(PASTE_OFF)

    def _run(self) -> int:
        if self.args.resume is not None:
            from ..prompt_cache.disk import SnapshotError
            try:
                self.load(self.args.resume, "--resume", "starting a new conversation")
            except (SnapshotError, OSError) as e:   # a name never saved, no usable directory
                raise CommandError(f"--resume {self.args.resume}: {e}") from None
        while True:
            try:
                line = _read_message()
                if line.startswith('"""'):
                    line = _read_block(line[3:])
                utf8_text(line, "that message")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                carry_on()
                print("\n(Ctrl-D or /quit exits)")
                continue
            except CommandError as e:
                print(f"error: {e}; it was not sent")
                continue
            if not line:
                continue
            if line.strip() in QUIT:
                return 0
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.answer(line)

    def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit", "/bye"):
            return False
        if name == "/reset":
            self.conversation.reset()
            self.session.reset()
            self.turns = []
            print("(conversation cleared)")
        elif name == "/stats":
            print(self.stats_text())
        elif name == "/think":
            self.think(line.split()[1:])
        elif name in ("/help", "/?"):
            print(HELP)
        elif name in ("/save", "/load"):
            from ..prompt_cache.disk import SnapshotError
            arg = line.split(maxsplit=1)[1:]
            if not arg:
                print(f"usage: {name} NAME")
                return True
            try:
                self.save(arg[0]) if name == "/save" else self.load(arg[0])
            except (SnapshotError, OSError) as e:
                print(f"error: {e}")
        else:
            print(f"unknown command {name}; /help lists the commands")
        return True

    def think(self, words: list[str]):
        if words not in (["on"], ["off"]):
            print("usage: /think on|off")
            return
        if "enable_thinking" not in (getattr(self.pair.tokenizer, "chat_template", None) or ""):
            print("(this model's chat template has no thinking switch)")
            return
        self.conversation.options["enable_thinking"] = words == ["on"]
        print(f"(thinking {words[0]} from the next answer)")

    def show(self, chunk, thinking: list[bool]):
        """Print a chunk: thinking dimmed on a terminal (or left out with --hide-thinking),
        then the answer."""
        if chunk.reasoning and not self.args.hide_thinking:
            if not thinking[0]:
                _write(DIM if sys.stdout.isatty() else "")
                thinking[0] = True
            _write(chunk.reasoning)
        if chunk.text:
            if thinking[0]:
                _write((PLAIN if sys.stdout.isatty() else "") + "\n")
                thinking[0] = False
            _write(chunk.text)

    def answer(self, user: str):
        ids = self.conversation.prompt(user)
        options = request_options(self.args)
        if self.args.seed is not None:     # a different, reproducible draw every turn
            options["seed"] = (self.args.seed + len(self.turns)) % SEEDS
        try:      # e.g. the conversation no longer fits the context
            request = api.make_request(self.pair, ids, **options)
        except ValueError as e:
            print(f"error: {flag_error(e)} (/reset starts a new conversation)")
            return
        interrupt = CatchInterrupt()
        # A message long enough to be stopped mid-prefill: the state before it, to go back to.
        known = len(self.session.tokens)
        before = self.session.snapshot() if known and len(
            piece_ends(known, [len(ids)], self.pair.target)) > 1 else None
        try:
            self._answer(user, ids, self._stream(user, ids, request, PrefillMeter(interrupt)),
                         interrupt)
        except KeyboardInterrupt:       # in the prefill, before its next piece
            carry_on()
            held = len(self.session.tokens)
            if before is not None:
                self.session.restore(before)
            else:
                self.session.reset()
            print(f"\n(stopped reading the message at {held} of {len(ids)} prompt tokens; "
                  f"it was not sent)")

    def _stream(self, user: str, ids: list[int], request, progress):
        """The answer's chunks; through the prompt cache when there is one, so the state is
        kept for a later chat."""
        cache = self.pair.prompt_cache
        if cache is None:
            return api.stream(self.pair, request, self.session, progress=progress)
        prompt = boundaries = None
        if not self.session.tokens:
            # a first turn: continue from a system prompt cached before (cache-prompt, an
            # earlier chat) and checkpoint its end for the next time
            messages = self.conversation.messages + [{"role": "user", "content": user}]
            prompt, boundaries = ids, message_boundaries(
                self.pair.tokenizer, messages, self.conversation.options, ids)
        return cache.through(self.session,
                             lambda s: api.stream(self.pair, request, s, progress=progress),
                             prompt, boundaries or ())

    def _answer(self, user: str, ids: list[int], stream, interrupt: CatchInterrupt):
        pieces, tokens, stats, thinking = [], [], None, [False]
        with interrupt:
            try:
                for chunk in stream:
                    self.show(chunk, thinking)
                    pieces.append(chunk.text)
                    stats = chunk.stats
                    if chunk.stop:
                        break       # the end-of-turn token: the template writes its own
                    tokens.append(chunk.token)
                    # Stop once every token the session has fed is shown: a round may have
                    # committed a few tokens ahead of the stream, and they are already paid for.
                    if interrupt.hit and len(self.session.tokens) < len(ids) + len(tokens):
                        stats.finish_reason = "interrupted"
                        break
            finally:
                stream.close()
        if thinking[0]:
            _write(PLAIN if sys.stdout.isatty() else "")
        text = "".join(pieces)
        if stats.finish_reason == "interrupted" and not thinking[0]:
            # the streaming detokenizer may hold back the end of a character: show it now
            full = self.pair.tokenizer.decode(tokens)
            if full.startswith(text):
                _write(full[len(text):])
                text = full
        print()
        print(format_line(stats))
        self.conversation.add_turn(user, ids, tokens, text)
        self.turns.append(stats)

    def stats_text(self) -> str:
        if not self.turns:
            return "no answers yet"
        return "\n".join([
            f"turns: {len(self.turns)}, context: {len(self.session.tokens)} tokens held by the "
            f"session", *format_stats(Stats.total(self.turns)),
            f"last answer: {format_line(self.turns[-1])}"])


def _saved_conversation(snap, extra) -> tuple[list, list]:
    """The messages and ids ``/save`` kept beside ``snap``; SnapshotError unless they are a
    conversation whose ids begin with the snapshot's tokens."""
    from ..prompt_cache.disk import SnapshotError
    messages, ids = extra.get("messages"), extra.get("ids")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages) \
            or not isinstance(ids, list) or not all(type(i) is int for i in ids) \
            or list(snap.tokens) != ids[:len(snap.tokens)]:
        raise SnapshotError("its conversation does not match its state")
    return messages, ids


def default_prompt_dir():
    """Where saved conversations go without --prompt-cache-dir."""
    from ..checkpoint.hub import cache_root
    return cache_root() / "prompts"


def _read_message() -> str:
    """One message: a line, or every line of a paste the terminal marked (bracketed paste)."""
    lines = [input(">>> ")]
    if PASTE_START in lines[0]:
        while PASTE_END not in lines[-1]:
            lines.append(input())
    return "\n".join(lines).replace(PASTE_START, "").replace(PASTE_END, "").strip()


def _read_block(first: str) -> str:
    """The rest of a message opened with triple quotes, up to the closing triple quotes (pasted
    code keeps its lines and indentation)."""
    lines = [first]
    while not lines[-1].rstrip().endswith('"""'):
        lines.append(input("... "))
    return "\n".join(lines).rstrip()[:-3].strip("\n")


def _write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()
