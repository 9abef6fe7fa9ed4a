"""The state of one token sequence, and the model contracts the loop relies on.

Models hold weights only. Everything a generation changes lives in a :class:`Session`: the
target's cache and the drafter's cache (both made by their model, ``make_cache()``), the
tokens fed so far, the drafter's pending taps, and where the break-even controller is kept.
Any number of sessions share one pair, in any interleaving; each gives the tokens it would
give alone."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import mlx.core as mx

from ..models.media_rows import text_ids
from ..policy.controller import Controller
from ..logits.draw import Draw


class Cache(Protocol):
    """A model's per-sequence state (target.TargetCache, drafter.DrafterCache)."""

    def arrays(self) -> list[mx.array]:
        """Every array the cache holds (evaluated after a commit)."""

    def snapshot(self):
        """This state, in arrays later steps do not change."""

    def restore(self, state):
        """Take the state of an earlier :meth:`snapshot` (which stays usable)."""


class Target(Protocol):
    """What the loop calls on a target (target.NemotronH; ARCHITECTURE.md, "The target")."""

    context_limit: int | None     # longest sequence the model takes, if it declares one
    config: object                # its config.vocab_size bounds the token ids, and its
                                  # config.hybrid_override_pattern says what each layer keeps
    dtype: object                 # the compute dtype (a snapshot restores only into its own)

    def make_cache(self) -> Cache: ...

    def step(self, tokens: mx.array, cache: Cache, tap_layers=None, last_only=False, also=0):
        """Feed ``tokens [1, T]``; returns ``(logits [1, T, V], taps [T, n*hidden] or None)``
        (``last_only``: the last row, after the ``also`` before it)."""

    def verify(self, tokens: mx.array, cache: Cache, tap_layers=None):
        """A step that ``commit`` can cut back to any prefix."""

    def commit(self, cache: Cache, n: int):
        """Keep the first ``n`` positions of the last verify (exact rollback of the rest)."""


class Drafter(Protocol):
    """What the loop calls on a drafter (every kind is a drafters/base.py DrafterBase;
    ARCHITECTURE.md)."""

    target_layer_ids: list[int]   # the target layers whose outputs feed add_context
    max_draft: int                # most tokens one propose() drafts
    context_keep: int | None      # context rows a future query can still see (None: all)

    def make_cache(self, start: int = 0) -> Cache:
        """An empty context whose first token sits at ``start``."""

    def add_context(self, taps: mx.array, start_pos: int, cache: Cache, tokens=None):
        """Commit the taps of the ``tokens`` at positions start_pos.. (a drafter that pairs
        each hidden state with the token after it, MTP or EAGLE-3, reads ``tokens``)."""

    def propose(self, bonus, n: int, draw: Draw | None = None, cache: Cache = None):
        """Lazy ``(tokens [n], logits [n, V])``: the drafts, each drawn as ``draw`` says
        (decode/draw.py: its logits through the processors with the tokens before it, a
        grammar's mask, then ``argmax(log warp(logits) + noise)``, argmax without noise, never
        an id from the vocab limit on; None: greedy), and the logits they were drawn from."""


@dataclass
class ControllerHome:
    """Where a session keeps its break-even controller between calls (a Pair is another: its
    sessions share what it learned about this machine's costs)."""

    controller: Controller | None = None


class Session:
    """Target cache and drafter cache of one growing token sequence.

    ``tokens`` are the tokens fed to the target so far. Taps of those tokens reach the drafter
    lazily (``pending``): serial steps only queue them, and the queue is flushed in one
    ``add_context`` call before the next proposal, so "auto" pays almost nothing for keeping
    the drafter ready while it decodes serially. A session may be passed to ``decode`` again
    with a prompt that extends ``tokens`` (a chat's next turn): only the new suffix is
    prefilled. With no drafter the session never speculates and collects no taps. Taps older
    than the drafter's ``context_keep`` are dropped while queued (no query will see them), so
    a long serial stretch keeps a window of them, not all.

    ``keep_prompt`` (``pair.session()``): prefill stops before each call's last prompt
    token and keeps that state (``kept``), so that a prompt that begins with it but not with
    all the session holds (a chat history the template renders otherwise after the last
    prompt, the same prompt again) continues from there instead of from nothing."""

    PENDING_WINDOWS = 2     # queue up to this many windows of taps before dropping old ones

    def __init__(self, target: Target, drafter: Drafter | None = None,
                 home: ControllerHome | None = None, keep_prompt: bool = False):
        self.target = target
        self.drafter = drafter
        self.home = home if home is not None else ControllerHome()
        self.keep_prompt = keep_prompt
        # Where prefill stops to take a snapshot (absolute positions) and what receives it:
        # a prompt cache sets both before a request (prompt_cache/); reset keeps them.
        self.checkpoints: tuple[int, ...] = ()
        self.on_checkpoint: Callable[["Session"], None] | None = None
        # Bumped by every decode started on this session and every restore: a generator
        # that finds it changed was overtaken and refuses to go on (run.Call.still_current).
        self.generation = 0
        self.reset()

    @property
    def controller(self) -> Controller | None:
        return self.home.controller

    @controller.setter
    def controller(self, controller: Controller | None):
        self.home.controller = controller

    def reset(self):
        """Forget every token (the caches start empty)."""
        self.cache = self.target.make_cache()
        self.draft_cache = self.drafter.make_cache() if self.drafter is not None else None
        self.tokens: list[int] = []
        self.pending: list[mx.array] = []
        self.pending_start = 0
        self.pending_rows = 0
        self.ahead = None   # a serial step built ahead and not yet fed (loop.Ahead)
        self.kept: Snapshot | None = None   # before the last prompt's last token (keep_prompt)
        self.kept_in = -1                   # the generation (call) that kept it
        # The chat messages these tokens are, with the answer, when the API was given
        # messages (api.py continues the conversation from them).
        self.messages: list[dict] = []

    def continued(self, messages: list[dict]) -> list[dict]:
        """The conversation ``messages`` ask for (mlx-lm's ``prompt_cache`` habit): messages
        whose first is not the held conversation's are its next messages, not a new
        conversation (``reset()`` starts one)."""
        held = self.messages
        return held + messages if held and self.tokens and messages[0] != held[0] \
            else messages

    def reuse(self, prompt: list[int]) -> int:
        """Put the session at the longest prefix of ``prompt`` it holds and return its
        length: all its tokens when the prompt extends them, else its ``kept`` state
        (restored) when the prompt begins with that, else none (the caches start empty). At
        least the prompt's last token is always left to prefill, for the next logits."""
        kept, kept_in = self.kept, self.kept_in
        if _begins(prompt, self.tokens):
            pass
        elif kept is not None and _begins(prompt, kept.tokens):
            self._take(kept)
            self.kept, self.kept_in = kept, kept_in
        else:
            self.reset()
        if self.keep_prompt and len(self.tokens) == len(prompt) - 1 \
                and self.kept_in != self.generation \
                and (self.kept is None or self.kept.tokens != tuple(self.tokens)):
            self._keep()        # no cut is left to keep it at
        return len(self.tokens)

    def cuts(self, prompt: list[int]) -> list[int]:
        """Where prefill stops before the end of ``prompt``: the ``checkpoints``, and before its
        last token when the session keeps that state."""
        ends = {c for c in self.checkpoints if len(self.tokens) < c < len(prompt)}
        if self.keep_prompt and self.kept_in != self.generation \
                and len(self.tokens) < len(prompt) - 1:
            ends.add(len(prompt) - 1)
        return sorted(ends)

    def checkpoint(self, prompt: list[int]):
        """Prefill stopped at one of :meth:`cuts`: keep the state before the prompt's last
        token (once per call: a thinking budget's later stretch keeps the request's), and hand
        the session to ``on_checkpoint``."""
        if self.keep_prompt and len(self.tokens) == len(prompt) - 1 \
                and self.kept_in != self.generation:
            self._keep()
        if self.on_checkpoint is not None:
            self.on_checkpoint(self)

    def _keep(self):
        self.kept, self.kept_in = self.snapshot(), self.generation

    @property
    def tap_layers(self):
        return tuple(self.drafter.target_layer_ids) if self.drafter is not None else None

    def feed(self, tokens: list[int], taps: mx.array | None):
        """Record ``tokens`` as fed to the target, and queue their taps for the drafter."""
        if taps is not None:
            if not self.pending:
                self.pending_start = len(self.tokens)
            self.pending.append(taps)
            self.pending_rows += taps.shape[0]
        self.tokens.extend(tokens)
        keep = self.drafter.context_keep if self.drafter is not None else None
        if keep and self.pending_rows > self.PENDING_WINDOWS * keep:
            # Nothing before the last ``keep`` tokens will be attended again: the drafter's
            # context restarts there (add_context would skip the same rows, so the result
            # is the same to the bit).
            # (copied out, so the rows dropped are freed, not kept alive by a view)
            taps = mx.contiguous(mx.concatenate(self.pending)[-keep:])
            self.pending, self.pending_rows = [taps], keep
            self.pending_start = len(self.tokens) - keep
            self.draft_cache = self.drafter.make_cache(start=self.pending_start)

    def flush(self) -> int:
        """Hand the queued taps to the drafter's cache (lazily); returns how many tokens."""
        if not self.pending:
            return 0
        taps = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending)
        start = self.pending_start
        self.drafter.add_context(taps, start, cache=self.draft_cache,
                                 tokens=text_ids(self.target,
                                                 self.tokens[start:start + taps.shape[0]]))
        self.pending, self.pending_rows = [], 0
        return taps.shape[0]

    @property
    def origin(self) -> "Origin":
        """The pair this session's snapshots belong to. Its models are known by the pair's
        conversion receipts when the session runs the pair's own models (``pair.session()``),
        and always by identity."""
        receipts = getattr(self.home, "receipts", (None, None))
        ours = [getattr(self.home, "target", None) is self.target,
                self.drafter is not None and getattr(self.home, "drafter", None) is self.drafter]
        model, drafter = (r if mine else None for r, mine in zip(receipts, ours))
        models = (weakref.ref(self.target),
                  None if self.drafter is None else weakref.ref(self.drafter))
        return Origin(model, drafter, drafter_kind(self.drafter),
                      str(getattr(self.target, "dtype", None)), models)

    def snapshot(self) -> "Snapshot":
        """The state after ``tokens``, to :meth:`restore` later (a server's prefix cache).
        Take it between steps (not between a verify and its commit)."""
        cache = self.cache.snapshot()
        draft = self.draft_cache.snapshot() if self.draft_cache is not None else None
        pending = tuple(self.pending)
        draft_arrays = self.draft_cache.arrays() if self.draft_cache is not None else []
        mx.eval(list(pending) + draft_arrays)
        snap = Snapshot(tuple(self.tokens), cache, draft, pending, self.pending_start, 0,
                        self.origin)
        return snap.with_nbytes()

    def restore(self, snap: "Snapshot"):
        """Continue from ``snap``, a snapshot of a session of the same pair; the snapshot
        stays valid, so it can be restored again. ValueError, with the session untouched,
        for another pair's snapshot (another target, drafter or dtype) or a state that does
        not fit this target (:func:`layout_problem`)."""
        problem = self.origin.mismatch(snap.origin) or \
            layout_problem(snap, self.target.config.hybrid_override_pattern,
                           self.origin.dtype)
        if problem is not None:
            raise ValueError(f"this snapshot does not restore into this session: {problem} "
                             f"(the session is unchanged)")
        self.generation += 1
        self._take(snap)

    def _take(self, snap: "Snapshot"):
        """Continue from ``snap`` (checked), within the call that runs."""
        self.reset()
        self.cache.restore(snap.cache)
        if self.draft_cache is not None:
            self.draft_cache.restore(snap.drafter)
        self.tokens = list(snap.tokens)
        self.pending = list(snap.pending)
        self.pending_start = snap.pending_start
        self.pending_rows = sum(t.shape[0] for t in self.pending)


@dataclass(frozen=True)
class Snapshot:
    """A session's state after ``tokens`` (:meth:`Session.snapshot`); ``nbytes`` sums its
    distinct arrays (an array shared with other snapshots counts in each; a PrefixCache
    counts it once)."""

    tokens: tuple[int, ...]
    cache: object
    drafter: object
    pending: tuple
    pending_start: int
    nbytes: int
    origin: "Origin"

    def arrays(self) -> list[mx.array]:
        """Every distinct array the snapshot holds."""
        seen, out = set(), []
        for x in _arrays([self.cache, self.drafter, list(self.pending)]):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        return out

    def with_nbytes(self) -> "Snapshot":
        return replace(self, nbytes=sum(x.nbytes for x in self.arrays()))


def _begins(prompt: list[int], held) -> bool:
    """Whether ``held`` tokens are a proper prefix of ``prompt``."""
    n = len(held)
    return n < len(prompt) and list(prompt[:n]) == list(held)


def _arrays(tree) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _arrays(t)]
    return []


def drafter_kind(drafter) -> str | None:
    """A drafter's kind as messages name it (its ``label``: "DSpark", "MTP", "EAGLE-3"; else
    its class name), or None without a drafter."""
    return None if drafter is None else getattr(drafter, "label", type(drafter).__name__)


@dataclass(frozen=True, eq=False)
class Origin:
    """The pair a snapshot belongs to; it restores only into sessions of that pair. The target
    and the drafter are known by their conversion receipts (hashes, also across processes)
    or, in this process, by identity: weak references, so a snapshot keeps no model alive."""

    model: str | None           # the target's receipt hash (None: not known)
    drafter: str | None         # the drafter's receipt hash (None: not known, or no drafter)
    kind: str | None            # drafter_kind(); None: no drafter
    dtype: str                  # the compute dtype, as str(dtype)
    models: tuple = ()          # weak references to (target, drafter); () when read from disk

    def mismatch(self, other: "Origin") -> str | None:
        """Why a snapshot of ``other`` cannot go into a session of this origin, in words;
        None when it can."""
        if other.kind != self.kind:
            return f"it was taken {_with(other.kind)} and this session runs {_with(self.kind)}"
        if other.dtype != self.dtype:
            return (f"it was computed in {_short(other.dtype)} and this session computes in "
                    f"{_short(self.dtype)}")
        for i, what in enumerate(("target", "drafter")):
            if self.kind is None and i == 1:
                break
            if not _same(self, other, i):
                return f"it belongs to another {what} ({_known(other, i)}; this session's: " \
                       f"{_known(self, i)})"
        return None


def _same(a: Origin, b: Origin, i: int) -> bool:
    """Whether ``a`` and ``b`` name the same target (``i`` 0) or drafter (1): the same receipt
    when both know one, else the same object."""
    ra, rb = (a.model, b.model) if i == 0 else (a.drafter, b.drafter)
    if ra is not None and rb is not None:
        return ra == rb
    if not a.models or not b.models or a.models[i] is None or b.models[i] is None:
        return False
    return a.models[i]() is not None and a.models[i]() is b.models[i]()


def _known(origin: Origin, i: int) -> str:
    receipt = origin.model if i == 0 else origin.drafter
    return f"receipt {receipt[:12]}…" if receipt else "no receipt"


def _with(kind: str | None) -> str:
    return "without a drafter" if kind is None else f"with the {kind} drafter"


def _short(dtype: str) -> str:
    return dtype.rsplit(".", 1)[-1]


def layout_problem(snap: Snapshot, pattern: str, dtype: str) -> str | None:
    """Why ``snap`` cannot be the state of a target with layers ``pattern`` computing in
    ``dtype`` (``str(dtype)``), in words; None when it can. A Mamba layer (``M``) holds its
    float32 conv window ``[1, K-1, C]`` and SSM state ``[1, h, p, n]``, an attention layer
    (``*``) its keys and values ``[1, heads, tokens, d]`` in ``dtype``, alike in every layer
    of a kind; other blocks hold nothing, and so do all before the first token. The queued
    taps ``[rows, width]`` (``dtype``) are those of the last tokens."""
    offset, layers = snap.cache
    if offset != len(snap.tokens):
        return f"its target cache holds {offset} positions for {len(snap.tokens)} tokens"
    if len(layers) != len(pattern):
        return f"it has {len(layers)} target layers, and this target {len(pattern)}"
    shapes: dict = {}
    for i, (kind, layer) in enumerate(zip(pattern, layers)):
        problem = _layer_problem(kind, layer, offset, dtype, shapes)
        if problem is not None:
            return f"target layer {i} ({kind}): {problem}"
    return _pending_problem(snap, dtype)


_STATES = {"M": ("conv window", "SSM state"), "*": ("keys", "values")}
_RANKS = {"conv window": 3, "SSM state": 4, "keys": 4, "values": 4}


def _layer_problem(kind: str, layer, offset: int, dtype: str, shapes: dict) -> str | None:
    names = _STATES.get(kind)
    if names is None or offset == 0:        # nothing kept, or nothing yet
        empty = layer is None or (kind == "M" and isinstance(layer, tuple)
                                  and all(x is None for x in layer))
        return None if empty else "a state where this target keeps none"
    if not isinstance(layer, tuple) or len(layer) != 2:
        return f"its {' and '.join(names)} are missing"
    want = str(mx.float32) if kind == "M" else dtype
    for name, x in zip(names, layer):
        if not isinstance(x, mx.array):
            return f"its {name} is missing"
        if x.ndim != _RANKS[name] or x.shape[0] != 1 or str(x.dtype) != want:
            return f"its {name} is {x.dtype} {tuple(x.shape)}, not {_short(want)} with " \
                   f"{_RANKS[name]} axes, the first 1"
        if kind == "*" and x.shape[2] != offset:
            return f"its {name} hold {x.shape[2]} positions, not {offset}"
        if shapes.setdefault(name, x.shape) != x.shape:
            return f"its {name} is {tuple(x.shape)}, another layer's {tuple(shapes[name])}"
    return None


def _pending_problem(snap: Snapshot, dtype: str) -> str | None:
    taps = snap.pending
    if any(not isinstance(t, mx.array) or t.ndim != 2 or str(t.dtype) != dtype
           or t.shape[1] != taps[0].shape[1] for t in taps):
        return f"its queued taps are not [rows, width] arrays of {_short(dtype)}"
    rows = sum(t.shape[0] for t in taps)
    if taps and snap.pending_start + rows != len(snap.tokens):
        return f"its {rows} queued taps from position {snap.pending_start} are not those " \
               f"of its last tokens ({len(snap.tokens)})"
    return None
