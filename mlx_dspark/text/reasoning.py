"""The model's thinking, told apart from its answer (free of MLX).

Nemotron thinks in a ``<think> … </think>`` block at the start of its reply; its chat template
opens the block at the end of the prompt (``<think>\\n``) when thinking is on and writes an
empty one (``<think></think>``) when it is off. A reply whose prompt opened the block is
thinking until ``</think>``; :class:`Splitter` cuts streamed text at that point, holding back
only what could still be the start of the closing tag, so streamed pieces join to exactly
what :func:`split` gives for the whole text."""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"
# What the engine feeds when a thinking budget runs out: the template's end of a thinking
# block, then the answer starts on a new line.
END = "\n" + CLOSE + "\n"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt (its rendered text, or at least its end) leaves a thinking block
    open, so the reply starts inside it."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and not prompt_text[at + len(OPEN):].strip() and CLOSE not in prompt_text[at:]


class Splitter:
    """Cuts the streamed text of a reply that starts inside a thinking block into
    ``(reasoning, content)`` pieces. The answer's leading newlines are dropped (the template
    writes them, the answer does not start with them)."""

    def __init__(self):
        self.thinking = True
        self.held = ""          # reasoning text that may be the start of CLOSE
        self.started = False    # the answer has shown a character other than a newline

    def add(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", self._content(text)
        text = self.held + text
        at = text.find(CLOSE)
        if at >= 0:
            self.thinking, self.held = False, ""
            return text[:at], self._content(text[at + len(CLOSE):])
        keep = partial_tag(text, CLOSE)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply (it was not a closing tag)."""
        held, self.held = self.held, ""
        return held, ""

    def _content(self, text: str) -> str:
        if not self.started:
            text = text.lstrip("\n")
            self.started = bool(text)
        return text


def split(text: str) -> tuple[str, str]:
    """``(reasoning, content)`` of the whole text of a reply that started thinking."""
    s = Splitter()
    r1, c1 = s.add(text)
    r2, _ = s.finish()
    return r1 + r2, c1


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
