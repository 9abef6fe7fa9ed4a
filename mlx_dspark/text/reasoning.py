"""The model's thinking, told apart from its answer (free of MLX).

Nemotron thinks in a ``<think> … </think>`` block at the start of its reply; its chat template
opens the block at the end of the prompt (``<think>\\n``) when thinking is on and writes an
empty one (``<think></think>``) when it is off. A reply whose prompt opened the block is
thinking until ``</think>``; :class:`Splitter` cuts streamed text at that point, and keeps any
tag the model writes outside a block out of the answer, holding back only what could still be
the start of a tag, so streamed pieces join to exactly what :func:`split` gives for the whole
text. :func:`thinking_of` and :func:`after_thinking` read a prompt's end with its tokenizer."""

from __future__ import annotations

from ..request import Thinking

OPEN = "<think>"
CLOSE = "</think>"
# What the engine feeds when a thinking budget runs out: the template's end of a thinking
# block, then the answer starts on a new line.
END = "\n" + CLOSE + "\n"


def closes_thinking(prompt_text: str) -> bool:
    """Whether a prompt (its rendered text, or at least its end) ends with an empty thinking
    block, the template's form of thinking off: the reply is an answer."""
    end = prompt_text.rstrip()
    return end.endswith(CLOSE) and end[:-len(CLOSE)].rstrip().endswith(OPEN)


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt (its rendered text, or at least its end) leaves a thinking block
    open, so the reply starts inside it."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and not prompt_text[at + len(OPEN):].strip() and CLOSE not in prompt_text[at:]


def thinking_of(tokenizer, prompt: list[int]) -> Thinking | None:
    """The request's :class:`~mlx_dspark.request.Thinking` when the prompt ends inside an open thinking block
    (the chat template opened it), else None."""
    if not opens_thinking(_tail(tokenizer, prompt)):
        return None
    def encode(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    return Thinking(close=encode(CLOSE), end=encode(END))


def after_thinking(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt ends with an empty thinking block (the chat template's thinking
    off): the reply is an answer, and a tag it writes is read, never shown."""
    return closes_thinking(_tail(tokenizer, prompt))


def _tail(tokenizer, prompt: list[int]) -> str:
    """The text of the prompt's last tokens ("" without a tokenizer, or for ids it has not:
    decode refuses them, and one clear error comes before any step)."""
    if tokenizer is None:
        return ""
    try:
        return tokenizer.decode(prompt[-16:])
    except (OverflowError, ValueError, TypeError):
        return ""


class Splitter:
    """Cuts the streamed text of a reply into ``(reasoning, content)`` pieces; ``thinking``:
    the reply starts inside a thinking block (its prompt opened one), else it starts as an
    answer after one (its prompt closed an empty block). The newlines that start an answer
    after a block closes are dropped (the template writes them, the answer does not start
    with them).

    A tag outside an open block never reaches the answer, as vLLM's and llama.cpp's reasoning
    parsers have it: a ``<think>`` before any answer text opens a block (llama.cpp reads a
    reply that starts with one as reasoning), any other ``<think>`` or ``</think>`` is dropped
    (vLLM skips the tags' own tokens). Inside a block only ``</think>`` means something: it
    closes it. What could still become a tag is held back, so streamed pieces join to exactly
    what :func:`split` gives for the whole text."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self.held = ""          # text that may be the start of a tag
        self.strip = False      # a block just closed: the answer's leading newlines go
        self.answered = False   # the answer has shown a character other than whitespace

    def add(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning, content = [], []
        while text:
            tags = (CLOSE,) if self.thinking else (OPEN, CLOSE)
            at, tag = min(((text.find(t), t) for t in tags if t in text), default=(-1, ""))
            if at < 0:
                keep = max(partial_tag(text, t) for t in tags)
                at, self.held = len(text) - keep, text[len(text) - keep:]
            if self.thinking:
                reasoning.append(text[:at])
            else:
                content.append(self._answer(text[:at]))
            if not tag:
                break
            text = text[at + len(tag):]
            if self.thinking:                       # the block closes
                self.thinking, self.strip = False, True
            elif tag == OPEN and not self.answered:
                self.thinking = True                # a stray tag is dropped: nothing else
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply (it was not a tag)."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", self._answer(held))

    def _answer(self, text: str) -> str:
        if self.strip:
            text = text.lstrip("\n")
            self.strip = not text
        self.answered = self.answered or bool(text.strip())
        return text


def split(text: str, thinking: bool = True) -> tuple[str, str]:
    """``(reasoning, content)`` of the whole text of a reply (``thinking``: it started inside
    a thinking block)."""
    s = Splitter(thinking)
    r1, c1 = s.add(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
