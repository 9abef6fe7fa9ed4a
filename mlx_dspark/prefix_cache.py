"""Session snapshots keyed by the tokens they hold, for requests that resend a conversation.

Chat clients send the whole conversation every turn. The Mamba layers' state cannot be rewound
to an earlier position, so the server snapshots the session at points a later request is likely
to start from (the end of each prompt's prefill and the end of each generation), and a request
continues from the longest snapshot whose tokens begin its prompt: only the rest is prefilled.

The cache holds at most ``budget`` bytes of arrays (the sum of each snapshot's ``nbytes``;
arrays two snapshots share count in both, so the real footprint is at most that) and evicts
the least recently used snapshot first. A snapshot larger than the whole budget is not kept."""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens) -> bool:
        return tuple(tokens) in self._entries

    def touch(self, tokens) -> bool:
        """Mark the snapshot of exactly ``tokens`` as used; False if there is none."""
        key = tuple(tokens)
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def add(self, snapshot) -> None:
        """Keep ``snapshot`` (anything with ``tokens`` and ``nbytes``), evicting the least
        recently used ones until it fits."""
        if snapshot.nbytes > self.budget or self.touch(snapshot.tokens):
            return
        while self.nbytes + snapshot.nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        self._entries[tuple(snapshot.tokens)] = snapshot
        self.nbytes += snapshot.nbytes

    def find(self, prompt) -> object | None:
        """The snapshot with the most tokens that are a proper prefix of ``prompt`` (at least
        one prompt token is left to prefill, for the logits of the next token)."""
        best = None
        for key, snap in self._entries.items():
            if len(key) < len(prompt) and (best is None or len(key) > len(best.tokens)) \
                    and tuple(prompt[:len(key)]) == key:
                best = snap
        if best is not None:
            self._entries.move_to_end(tuple(best.tokens))
        return best
