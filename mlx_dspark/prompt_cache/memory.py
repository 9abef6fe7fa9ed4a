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

The cache holds at most ``budget`` bytes. Each snapshot has a rank, and the cache evicts the
lowest rank first, the least recently used first within a rank: the checkpoints near a prompt's
end that serve an edit of its tail (``EDIT``) go before message ends, prompt ends and answers
(``TURN``), which go before the end of a conversation's first message, its system prompt and
tools (``SYSTEM``): the one prefix every new conversation of an agent shares. It counts what it
really holds: each distinct array once, however many snapshots share it (Mamba
states, the drafter's context and queued taps are shared references; attention keys and values
are copies). A snapshot larger than the whole budget is not kept."""

from __future__ import annotations

from collections import OrderedDict

EDIT, TURN, SYSTEM = range(3)       # ranks: the lowest is evicted first
RANKS = {EDIT: "edit", TURN: "turn", SYSTEM: "system"}


class PrefixCache:
    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0                 # bytes of the distinct arrays held
        self._entries: OrderedDict[tuple, object] = OrderedDict()   # (space, tokens) -> snap
        self._rank: dict[tuple, int] = {}                            # (space, tokens) -> rank
        self._held: dict[int, list] = {}        # id(array) -> [array, snapshots holding it]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens) -> bool:
        return ("", tuple(tokens)) in self._entries

    def touch(self, tokens, space: str = "", rank: int = EDIT) -> bool:
        """Mark the snapshot of exactly ``tokens`` as used, its rank raised to ``rank``;
        False if there is none."""
        key = (space, tuple(tokens))
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        self._rank[key] = max(self._rank[key], rank)
        return True

    def ranks(self) -> dict[str, int]:
        """How many snapshots the cache holds of each rank (``/health``)."""
        counts = dict.fromkeys(RANKS.values(), 0)
        for rank in self._rank.values():
            counts[RANKS[rank]] += 1
        return counts

    def add(self, snapshot, space: str = "", rank: int = TURN) -> None:
        """Keep ``snapshot`` (a session.Snapshot, or anything with ``tokens`` and ``nbytes``)
        in ``space`` at ``rank``, evicting (lowest rank, then least recently used) until it
        fits."""
        if self.touch(snapshot.tokens, space, rank) or \
                self._new_bytes(snapshot) > self.budget:
            return
        while self.nbytes + self._new_bytes(snapshot) > self.budget:
            self._evict()
        key = (space, tuple(snapshot.tokens))
        self._entries[key], self._rank[key] = snapshot, rank
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

    def _evict(self):
        """Drop the least recently used snapshot of the lowest rank held."""
        low = min(self._rank.values())
        key = next(k for k in self._entries if self._rank[k] == low)
        del self._rank[key]
        self._release(self._entries.pop(key))

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
