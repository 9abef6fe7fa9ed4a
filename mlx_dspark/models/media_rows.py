"""Media in a prompt as token ids: each image or audio clip's embeddings stand at ids past the
vocabulary (``vocab + k``), one id per placeholder position, the same ids for the same content
(so the prompt cache, keyed by token prefixes, reuses a prompt through an image it has seen
and nothing from a different image on). The target embeds such ids as their rows
(:func:`step_input`); everything that reads ids as text (drafters, penalties) sees the
placeholder token the checkpoint's processor writes there (:func:`text_ids`).

Rows are computed on first use (the vision or audio tower runs on the thread that prefills)
and kept for the :data:`KEPT` most recent media; ids are never given to other content."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

KEPT = 32
"""Media whose rows (or what computes them) stay held; older ones are computed again when
the same content is sent again."""


class MediaGone(ValueError):
    """A prompt names media whose rows were let go before its prefill."""


@dataclass
class Block:
    base: int                     # its first id
    n: int                        # positions (ids base .. base + n - 1)
    placeholder: int              # the text token at those positions
    compute: Callable | None = None       # () -> rows [n, hidden]; None once let go
    rows: mx.array | None = field(default=None, repr=False)


class MediaRows:
    """The ids of one target's media (``target.media_rows``)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._next = vocab
        self._by_key: dict[str, Block] = {}
        self._bases: list[int] = []
        self._blocks: list[Block] = []
        self._held: OrderedDict[str, Block] = OrderedDict()
        self._lock = threading.Lock()     # requests register while the engine reads

    def register(self, key: str, n: int, placeholder: int, compute: Callable) -> range:
        """The ids of the content ``key`` (a hash of its bytes and how it was processed):
        ``n`` positions, embedded by ``compute()`` when first prefilled."""
        with self._lock:
            block = self._by_key.get(key)
            if block is None:
                block = Block(self._next, n, placeholder)
                self._next += n
                self._by_key[key] = block
                self._bases.append(block.base)
                self._blocks.append(block)
            if block.rows is None and block.compute is None:
                block.compute = compute
            self._held[key] = block
            self._held.move_to_end(key)
            while len(self._held) > KEPT:
                _, old = self._held.popitem(last=False)
                old.compute, old.rows = None, None
            return range(block.base, block.base + block.n)

    def held(self, key: str) -> range | None:
        """The ids of the content ``key`` while its rows (or what computes them) are held."""
        with self._lock:
            block = self._by_key.get(key)
            if block is None or block.rows is None and block.compute is None:
                return None
            self._held.move_to_end(key)
            return range(block.base, block.base + block.n)

    def block(self, token: int) -> Block | None:
        """The block holding the id ``token`` (None for a text id or one never given)."""
        if token < self.vocab:
            return None
        i = bisect.bisect_right(self._bases, token) - 1
        block = self._blocks[i] if i >= 0 else None
        return block if block is not None and token < block.base + block.n else None

    def rows(self, block: Block) -> mx.array:
        with self._lock:
            if block.rows is None:
                if block.compute is None:
                    raise MediaGone("an image or audio clip of this prompt was let go before "
                                    "its prefill (more than "
                                    f"{KEPT} others came after it); send it again")
                block.rows, block.compute = block.compute(), None
            return block.rows


def _table(target) -> MediaRows | None:
    return getattr(target, "media_rows", None)


def known(target, token: int) -> bool:
    """Whether ``token`` is a text id of ``target`` or one of its media ids."""
    table = _table(target)
    vocab = target.config.vocab_size
    return 0 <= token < vocab or (table is not None and table.block(token) is not None)


def text_ids(target, ids: list[int]) -> list[int]:
    """``ids`` with each media id replaced by its placeholder token."""
    table = _table(target)
    if table is None or not ids or max(ids) < table.vocab:
        return ids
    return [t if t < table.vocab else table.block(t).placeholder for t in ids]


def step_input(target, ids: list[int]) -> mx.array:
    """What ``target.step`` takes for ``ids``: the ids ``[1, T]``, or, where media ids are
    among them, the embeddings ``[1, T, hidden]`` with each media position's row."""
    table = _table(target)
    if table is None or not ids or max(ids) < table.vocab:
        return mx.array([ids])
    parts, start = [], 0
    while start < len(ids):
        block = table.block(ids[start])
        end = start + 1
        if block is None:
            while end < len(ids) and ids[end] < table.vocab:
                end += 1
            parts.append(target.embed(mx.array([ids[start:end]]))[0])
        else:
            while end < len(ids) and ids[end] == ids[end - 1] + 1 \
                    and ids[end] < block.base + block.n:
                end += 1
            first = ids[start] - block.base
            parts.append(table.rows(block)[first:first + end - start].astype(target.dtype))
        start = end
    return mx.concatenate(parts)[None]
