"""Session snapshots keyed by the tokens they hold, for requests that resend a conversation.

Chat clients send the whole conversation every turn, and agents send the same long system
prompt before each new conversation. The Mamba layers' state cannot be rewound to an earlier
position, so the server snapshots the session at points a later request is likely to start
from (message ends and every K tokens while prefilling, the end of each prompt and of each
generation; prompt_cache/), and a request continues from the longest snapshot whose tokens
begin its prompt: only the rest is prefilled.

Snapshots live in *spaces* (a hash of the API key and the request's ``cache_salt``): a request
only ever finds snapshots of its own space, so whether a prompt was cached tells nothing about
other users' prompts.

The cache holds at most ``budget`` bytes and evicts the least recently used snapshot first. It
counts what it really holds: each distinct array once, however many snapshots share it (Mamba
states, the drafter's context and queued taps are shared references; attention keys and values
are copies). A snapshot larger than the whole budget is not kept."""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0                 # bytes of the distinct arrays held
        self._entries: OrderedDict[tuple, object] = OrderedDict()   # (space, tokens) -> snap
        self._held: dict[int, list] = {}        # id(array) -> [array, snapshots holding it]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens) -> bool:
        return ("", tuple(tokens)) in self._entries

    def touch(self, tokens, space: str = "") -> bool:
        """Mark the snapshot of exactly ``tokens`` as used; False if there is none."""
        key = (space, tuple(tokens))
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def add(self, snapshot, space: str = "") -> None:
        """Keep ``snapshot`` (a session.Snapshot, or anything with ``tokens`` and ``nbytes``)
        in ``space``, evicting the least recently used ones until it fits."""
        if self.touch(snapshot.tokens, space) or self._new_bytes(snapshot) > self.budget:
            return
        while self.nbytes + self._new_bytes(snapshot) > self.budget:
            self._release(self._entries.popitem(last=False)[1])
        self._entries[(space, tuple(snapshot.tokens))] = snapshot
        for x in _parts(snapshot):
            held = self._held.setdefault(id(x), [x, 0])
            if held[1] == 0:
                self.nbytes += x.nbytes
            held[1] += 1

    def find(self, prompt, space: str = "") -> object | None:
        """The snapshot of ``space`` with the most tokens that are a proper prefix of
        ``prompt`` (at least one prompt token is left to prefill, for the next logits)."""
        best = None
        for (where, key), snap in self._entries.items():
            if where == space and len(key) < len(prompt) \
                    and (best is None or len(key) > len(best.tokens)) \
                    and tuple(prompt[:len(key)]) == key:
                best = snap
        if best is not None:
            self._entries.move_to_end((space, tuple(best.tokens)))
        return best

    def _new_bytes(self, snapshot) -> int:
        """Bytes ``snapshot`` would add: its arrays the cache does not hold yet."""
        return sum(x.nbytes for x in _parts(snapshot) if id(x) not in self._held)

    def _release(self, snapshot):
        for x in _parts(snapshot):
            held = self._held[id(x)]
            held[1] -= 1
            if held[1] == 0:
                del self._held[id(x)]
                self.nbytes -= x.nbytes


def _parts(snapshot) -> list:
    """What a snapshot holds, in units counted once each: its distinct arrays (or the whole
    thing, for an object that only states its ``nbytes``)."""
    return snapshot.arrays() if hasattr(snapshot, "arrays") else [snapshot]
