"""The target's per-sequence state: ``KVCache`` (attention), ``MambaCache`` (conv window and SSM
state, with what a verify records for exact rollback) and ``TargetCache``, one per layer, with
its snapshots and restore points. A drafter's attention keeps a ``KVCache`` too. ``RowsCache``
shows several sequences' own caches to one forward as a batch (docs/batching.md)."""

from __future__ import annotations

import mlx.core as mx

from ..kernels import mamba as K


class KVCache:
    """Attention keys/values ``(b, kv_heads, L, head_dim)`` in a buffer grown in steps."""

    STEP = 256

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update(self, k, v):
        t = k.shape[2]
        if self.keys is None or self.offset + t > self.keys.shape[2]:
            grow = ((self.offset + t + self.STEP - 1) // self.STEP) * self.STEP
            shape = (*k.shape[:2], grow, k.shape[3])
            nk, nv = mx.zeros(shape, k.dtype), mx.zeros(shape, v.dtype)
            if self.offset:
                nk[..., :self.offset, :] = self.keys[..., :self.offset, :]
                nv[..., :self.offset, :] = self.values[..., :self.offset, :]
            self.keys, self.values = nk, nv
        self.keys[..., self.offset:self.offset + t, :] = k
        self.values[..., self.offset:self.offset + t, :] = v
        self.offset += t
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def state(self):
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]


class MambaCache:
    """Conv window (the last K-1 raw conv inputs) and SSM state, both float32.

    ``record`` is set by a verify: the state before the block and the per-position inputs
    the recurrence needs, so that :meth:`commit` can rebuild any prefix exactly."""

    def __init__(self):
        self.conv = None
        self.ssm = None
        self.record = None

    def commit(self, n: int, A):
        conv0, ssm0, xbc, x, dt, B, C = self.record
        self.record = None
        if n == xbc.shape[1]:
            return                                    # full acceptance: state is current
        k1 = conv0.shape[1]
        self.conv = mx.concatenate([conv0, xbc[:, :n]], axis=1)[:, -k1:] if k1 else conv0
        self.ssm = K.ssm_replay(ssm0, x[:, :n], dt[:, :n], A, B[:, :n], C[:, :n])


class TargetCache:
    """One entry per layer (KVCache, MambaCache, or None for stateless blocks)."""

    def __init__(self, pattern: str):
        self.layers = [KVCache() if c == "*" else MambaCache() if c == "M" else None
                       for c in pattern]
        self.offset = 0
        self.pending = None          # positions of the last verify, until commit

    def __getitem__(self, i):
        return self.layers[i]

    def advance(self, t: int):
        self.offset += t

    def snapshot(self):
        """This state in arrays that later steps cannot change, for :meth:`restore`. KV buffers
        are written in place (slice assignment), so their filled part is copied; Mamba states
        are only ever replaced, never written into, so they are shared, unless they are a row
        of a batched step's states (a view that would keep every row alive: copied out)."""
        if self.pending is not None:
            raise RuntimeError("snapshot() between a verify and its commit")
        layers = tuple(None if c is None else
                       tuple(None if x is None else mx.contiguous(x) for x in (c.conv, c.ssm))
                       if isinstance(c, MambaCache) else
                       None if c.keys is None else tuple(mx.contiguous(x) for x in c.state())
                       for c in self.layers)
        mx.eval([x for layer in layers if layer for x in layer if x is not None])
        return self.offset, layers

    def restore(self, state):
        """Take the state of an earlier :meth:`snapshot` (which stays usable)."""
        self.offset, layers = state
        self.pending = None
        for c, s in zip(self.layers, layers):
            if isinstance(c, MambaCache):
                (c.conv, c.ssm), c.record = s, None
            elif isinstance(c, KVCache):
                c.keys = c.values = None
                c.offset = 0
                if s is not None:
                    c.update(*s)      # into a fresh buffer: the snapshot is never written

    def arrays(self) -> list[mx.array]:
        """Every array the cache holds (to evaluate pending rollback work)."""
        return _arrays(self)

    def mark(self):
        """A cheap restore point (offsets and references to the Mamba states, no copies)."""
        return self.offset, [c.offset if isinstance(c, KVCache) else (c.conv, c.ssm)
                             if isinstance(c, MambaCache) else None for c in self.layers]

    def rewind(self, mark):
        """Forget every step taken since ``mark`` (the decode loop's step built ahead)."""
        self.offset, states = mark
        for c, state in zip(self.layers, states):
            if isinstance(c, KVCache):
                c.offset = state
            elif isinstance(c, MambaCache):
                c.conv, c.ssm = state


class KVRows:
    """One attention layer of rows decoded together: each row keeps its own ``KVCache`` and
    attends over its own keys alone, so no row's softmax sees padding (with OpenBLAS a padded,
    masked softmax differs from the unpadded one in the last bit; docs/batching.md)."""

    def __init__(self, rows: list[KVCache]):
        self.rows = rows


class MambaRows:
    """One Mamba layer of rows decoded together, read and written as a ``MambaCache`` with a
    leading row axis: the rows' states stacked on reading, each row's slice written back to its
    own cache (the verify's record too, so each row commits on its own)."""

    def __init__(self, rows: list[MambaCache]):
        self.rows = rows
        self._stacked = {}

    def _stack(self, name):
        if name not in self._stacked:
            states = [getattr(c, name) for c in self.rows]
            known = next((s for s in states if s is not None), None)
            self._stacked[name] = None if known is None else mx.concatenate(
                [mx.zeros_like(known) if s is None else s for s in states])
        return self._stacked[name]

    def _split(self, name, value):
        self._stacked[name] = value
        for i, c in enumerate(self.rows):
            setattr(c, name, value[i:i + 1])

    conv = property(lambda self: self._stack("conv"), lambda self, v: self._split("conv", v))
    ssm = property(lambda self: self._stack("ssm"), lambda self, v: self._split("ssm", v))

    @property
    def record(self):
        return None

    @record.setter
    def record(self, record):
        for i, c in enumerate(self.rows):
            c.record = tuple(x[i:i + 1] for x in record)


class RowsCache:
    """Several sequences' ``TargetCache``s seen by one forward as a batch of rows
    (``NemotronH.step_rows``): row ``i`` reads and advances ``caches[i]`` alone, so a row joins
    or leaves a batch between steps without touching the others, and commits its own verify."""

    def __init__(self, caches: list[TargetCache]):
        self.caches = caches
        self.layers = [KVRows(rows) if isinstance(rows[0], KVCache) else
                       MambaRows(rows) if isinstance(rows[0], MambaCache) else None
                       for rows in zip(*(c.layers for c in caches))]

    def __getitem__(self, i):
        return self.layers[i]

    def advance(self, t: int):
        for c in self.caches:
            c.advance(t)


def _arrays(cache):
    """Every array held by a target cache (to evaluate pending rollback work)."""
    if isinstance(cache, mx.array):
        return [cache]
    if isinstance(cache, (list, tuple)):
        return [x for c in cache for x in _arrays(c)]
    if isinstance(cache, dict):
        return [x for c in cache.values() for x in _arrays(c)]
    if hasattr(cache, "__dict__"):
        return [x for c in vars(cache).values() for x in _arrays(c)]
    return []
