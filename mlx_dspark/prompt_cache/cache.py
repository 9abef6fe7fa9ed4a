"""Where a prompt is continued from: snapshots in memory (prompt_cache/memory.py) and on disk
(prompt_cache/disk.py), and where new ones are taken.

Before a request, :meth:`PromptCache.start` restores the longest snapshot of the request's
space whose tokens begin the prompt (memory or disk, whichever holds more of it) and plans
checkpoints for the rest of the prefill: the end of each chat message (``boundaries``: the
end of the system prompt and tool definitions is the first), every ``every`` tokens of a
long prompt, and before its last token (the same prompt again, a completion or a single
message, finds all but that token). Prefill stops at each (decode/prefill.py), the session
is snapshotted, and a later request that shares the prefix up to there, whatever follows,
continues from it. The engine also remembers the end of each answer (the next turn of a chat).

Agents rewrite the tail of their last message from one call to the next, so the prefill also
stops near the prompt's end (``TAIL``: at or before 500, 128 and 16 tokens before the end of
the last message, taken as 32 tokens before the prompt's end), where an edit of the message's
last 500 tokens finds a checkpoint less than a Mamba chunk (64 tokens on the demo pair, 128 on
Lightning) before the distance it falls under. Those stops are silent (decode/pieces.py
``silent``): a whole number of the Mamba scan's chunks past the stop before them, so a prompt
computes the same bits with them or without them, and the edited prompt continued from one
computes what its own cold run computes.
They are kept in memory only (an edit comes seconds later, not after a restart) and are the
first evicted (memory.py: ``EDIT`` before ``TURN`` before ``SYSTEM``, the end of the first
message, which every new conversation of the same agent shares).

A request continued from a checkpoint computes what its cold run computed after that point,
piece for piece: the cuts come from the prompt alone (its message ends and multiples of
``every``), and a cold run with a cache cuts at the same places.

``every`` (``CHECKPOINT_EVERY``) is a measured choice: a snapshot copies the attention keys
and values so far and holds the Mamba states (tens of MB at Lightning's shapes); one every
4096 tokens costs a few percent of prefilling those tokens (benchmarks/bench_prompt_cache.py,
docs/prompt-cache.md)."""

from __future__ import annotations

from ..decode import pieces
from .memory import EDIT, SYSTEM, TURN, PrefixCache

CHECKPOINT_EVERY = 4096
GENERATION_PROMPT = 32  # tokens after the last message a chat template adds (demo: 29 at most)
# Where a checkpoint goes for an edit of the last message (at or before, tokens before the
# prompt's end): 500, 128 and 16 tokens before that message's end.
TAIL = tuple(d + GENERATION_PROMPT for d in (500, 128, 16))


class PromptCache:
    def __init__(self, memory_bytes: int, store=None, every: int = CHECKPOINT_EVERY):
        self.memory = PrefixCache(memory_bytes) if memory_bytes > 0 else None
        self.store = store                  # a disk.PromptStore, or None
        self.every = every
        self.found = {"memory": 0, "disk": 0, "none": 0}

    def start(self, session, prompt, boundaries=(), space: str = "") -> int:
        """Put ``session`` at the longest cached prefix of ``prompt`` (or empty) and plan the
        snapshots of the rest of its prefill; returns how many tokens were restored."""
        snap = self.memory.find(prompt, space) if self.memory is not None else None
        if self._from_disk(session, prompt, space, len(snap.tokens) if snap else 0):
            where = "disk"
        elif snap is not None:
            where = "memory"
            session.restore(snap)
        else:
            where = "none"
            session.reset()
        self.found[where] += 1
        start, end = len(session.tokens), len(prompt)
        cuts = {b for b in boundaries if start < b < end}
        cuts.update(range((start // self.every + 1) * self.every, end, self.every))
        if start < end - 1:     # before the last token: serves this prompt again, and any
            cuts.add(end - 1)   # longer one (an identical repeat has no other boundary)
        rank = dict.fromkeys(cuts, TURN)
        if boundaries and boundaries[0] in rank:
            rank[boundaries[0]] = SYSTEM
        rank.update(dict.fromkeys(self._tail(session, prompt, boundaries, cuts) - cuts, EDIT))
        session.checkpoints = tuple(sorted(rank))
        session.on_checkpoint = lambda s: self.remember(s, space, rank.get(len(s.tokens), TURN))
        return start

    def _tail(self, session, prompt, boundaries, cuts) -> set[int]:
        """Where the prefill also stops near the prompt's end, inside its last message (after
        the last boundary), for an edit there: at or before each ``TAIL`` distance from the
        end, where a stop changes nothing computed (pieces.silent). None without a memory
        tier, which alone keeps them."""
        start, end = len(session.tokens), len(prompt)
        last = max([start, *(b for b in boundaries if b < end)])
        wanted = [end - d for d in TAIL if end - d > last]
        if self.memory is None or not wanted:
            return set()
        return pieces.silent(sorted({start, end, *cuts}), wanted, session.target)

    def _from_disk(self, session, prompt, space: str, longer_than: int) -> bool:
        """Restore into ``session`` the longest snapshot on disk of ``space`` that begins
        ``prompt`` with more than ``longer_than`` tokens; False when there is none it takes
        (one that the store or the session refuses is dropped, with one warning)."""
        entry = self.store.find(prompt, space, longer_than) if self.store is not None else None
        snap = self.store.load(entry) if entry is not None else None
        if snap is None:
            return False
        try:
            session.restore(snap)
        except ValueError as e:         # refused before anything changed
            self.store.drop(entry, str(e))
            return False
        if self.memory is not None:
            self.memory.add(snap, space)
        return True

    def finish(self, session):
        """The request is over: no more checkpoints on this session."""
        session.checkpoints, session.on_checkpoint = (), None

    def through(self, session, generation, prompt=None, boundaries=(), space: str = ""):
        """Yield the chunks of ``generation(session)``, the one way the API, ``chat`` and the
        server's engine run a generation on a cached session: ``session`` first continues
        from the longest cached prefix of ``prompt`` (None: as it stands, a chat's next
        turn), checkpoints are taken while it prefills, and its state is remembered at the
        end of the prompt (with a ``prompt``: before its last token, a checkpoint; else once
        the first chunk is out, before the next token is fed) and at the end of the
        generation, also when the consumer stops early; not after a failure, which may leave
        the state half-updated."""
        if prompt is not None:
            self.start(session, prompt, boundaries, space)
        chunks = generation(session)
        try:
            for i, chunk in enumerate(chunks):
                yield chunk
                if i == 0 and prompt is None:   # the first token is out: the prompt's state
                    self.remember(session, space)
        except GeneratorExit:           # the consumer stopped early: what was fed is kept
            pass
        finally:
            chunks.close()
            self.finish(session)
        self.remember(session, space)

    def remember(self, session, space: str = "", rank: int = TURN):
        """Keep the session's present state at ``rank`` (memory.py; in memory, and on disk
        when there is a store, unless it only serves an edit of the tail: ``EDIT``)."""
        tokens = session.tokens
        if not tokens:
            return
        in_memory = self.memory is None or self.memory.touch(tokens, space, rank)
        # Media ids (models/media_rows.py) mean their content in this process only.
        on_disk = self.store is None or rank == EDIT \
            or max(tokens) >= session.target.config.vocab_size or (space, tokens) in self.store
        if in_memory and on_disk:
            return
        snap = session.snapshot()
        if not in_memory:
            self.memory.add(snap, space, rank)
        if not on_disk:
            self.store.add(snap, space)

    def health(self) -> dict:
        """What ``/health`` shows."""
        out = {"found": dict(self.found), "checkpoint_every": self.every,
               "tail": list(TAIL)}
        if self.memory is not None:
            out["memory"] = {"snapshots": len(self.memory), "bytes": self.memory.nbytes,
                             "budget_bytes": self.memory.budget, "ranks": self.memory.ranks()}
        if self.store is not None:
            out["disk"] = {"dir": self.store.dir, "snapshots": len(self.store.entries),
                           "bytes": self.store.nbytes, "budget_bytes": self.store.budget,
                           "writes": self.store.writes, "reads": self.store.reads,
                           "write_s": round(self.store.t_write, 3),
                           "read_s": round(self.store.t_read, 3)}
        return out
