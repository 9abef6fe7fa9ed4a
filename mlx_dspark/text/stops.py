"""Stop strings found in streamed text (free of MLX): where the first one to be completed ends
the text, and how much of the text's end is held back because it could still become one.

An Aho-Corasick automaton over the stop strings reads, for each token, the text not yet shown:
what was held back (shorter than the longest stop string) and the token's new characters. So a
token costs O(longest stop string + its own text), however long the text so far and however
many stop strings there are; the text already shown is never read again."""

from __future__ import annotations


class StopScanner:
    """Reads a streamed text for ``stops`` (non-empty strings), one token's worth at a time.

    The text is taken as final up to what :meth:`scan` allowed to be shown; what it held back
    is read again with the next token's characters (a detokenizer may still change it)."""

    def __init__(self, stops):
        self._next: list[dict[str, int]] = [{}]   # the trie of the stop strings, node -> edges
        self._fail = [0]        # node -> the node of its longest proper suffix in the trie
        self._depth = [0]       # node -> its length, in characters
        self._stop: list[str | None] = [None]     # node -> the longest stop string ending here
        for s in stops:
            self._insert(s)
        self._link()
        self._shown = 0         # the node the text shown so far ends in

    def scan(self, tail: str) -> tuple[int, str | None]:
        """``tail``: the text after what was shown. Returns ``(end, stop)``: with ``stop`` (the
        first stop string completed in it, the longest of those completed at the same
        character), the text ends at ``end`` (an index into ``tail``); without, ``tail[:end]``
        may be shown and the rest could still begin a stop string."""
        node, nodes = self._shown, []
        for i, ch in enumerate(tail):
            node = self._step(node, ch)
            stop = self._stop[node]
            if stop is not None:
                return i + 1 - len(stop), stop
            nodes.append(node)
        end = max(len(tail) - self._depth[node], 0)
        if end:
            self._shown = nodes[end - 1]
        return end, None

    def _step(self, node: int, ch: str) -> int:
        while ch not in self._next[node] and node:
            node = self._fail[node]
        return self._next[node].get(ch, 0)

    def _insert(self, s: str):
        node = 0
        for ch in s:
            if ch not in self._next[node]:
                self._next[node][ch] = len(self._next)
                self._next.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._stop.append(None)
            node = self._next[node][ch]
        self._stop[node] = s

    def _link(self):
        """Suffix links, breadth first (a node's link is shallower, so it is linked before
        it); a node with no stop string of its own ends the longest one its link ends."""
        todo = list(self._next[0].values())
        for node in todo:
            for ch, child in self._next[node].items():
                if node:
                    self._fail[child] = self._step(self._fail[node], ch)
                todo.append(child)
            if self._stop[node] is None:
                self._stop[node] = self._stop[self._fail[node]]
