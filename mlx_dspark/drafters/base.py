"""What every drafter shares: the contract the loop calls (decode/session.py's ``Drafter``), its
context intake, its draw chain, and the steps of loading a converted directory.

A drafter kind is a :class:`DrafterBase` that says how its context rows are made and how one
draft follows another; the rest is here, once:

* ``add_context(taps, start_pos, cache, tokens)`` (:meth:`DrafterBase.add_context`): checks that
  the taps continue the cache, skips the rows no future query sees (``context_keep``), turns the
  taps into the kind's rows (``features``), pairs each with the token after it when the kind
  reads tokens (``pairs_tokens``: the newest row waits in ``cache.last``), and hands the rows to
  the kind (``context_rows``).
* ``propose(bonus, n, draw)`` (:meth:`DrafterBase.propose`): the loop hands one
  :class:`~mlx_dspark.logits.draw.Draw` (the request's sampling, the noise, a grammar's
  constraint, the logits processors and the history before the first draft), and the kind's
  ``draft`` runs its rows through :meth:`Draw.chain`: row logits, then the processors, then the
  grammar's mask, then Gumbel-max (argmax when greedy), then the next row.
* ``load(source, target, *, dtype, verify, verbose, nvfp4)`` in each kind's module (registered
  in drafters/__init__.py): :func:`read_converted` and :func:`draft_dtype` for the shared steps.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.integrity import check_checkpoint
from ..converter.layout import LAYOUT
from ..logits.draw import Draw
from ..models.nemotron_h import compute_dtype
from ..models.weights import CheckpointError, _embedding_identical, read_weights, shared_embedding

DrafterError = CheckpointError
"""A drafter checkpoint that cannot be used (bad file, unsupported variant, wrong target)."""


# --------------------------------------------------------------------------------------------
# The drafter


class OwnCache:
    """A drafter's cache of its own, for callers that use the drafter alone (tests, the contract
    in ARCHITECTURE.md, "The drafter"); the decode loop always passes a session's."""

    _own = None

    def _cache(self, cache):
        if cache is not None:
            return cache
        if self._own is None:
            self._own = self.make_cache()
        return self._own

    def reset(self):
        """Forget the context of the drafter's own cache (sessions reset theirs)."""
        self._own = None


class DrafterBase(OwnCache, nn.Module):
    """The drafter contract, written once. A kind sets ``label`` (its name in messages),
    ``pairs_tokens``, ``context_keep`` (None: every row stays), ``target_layer_ids``,
    ``max_draft``, and defines:

    * ``tap_width``: the width of one row of taps it takes;
    * ``make_cache(start)``: an empty context (with ``length``, and ``last`` when it pairs);
    * ``features(taps [T, tap_width])``: the rows the taps become, ``[T, ...]``;
    * ``context_rows(rows, ids, pos0, cache)``: commit rows at positions pos0.. (``ids``: the
      token after each row when it pairs, else None);
    * ``draft(bonus [1], n, draw, cache)``: the drafts, through ``draw.chain``.

    The target is borrowed (its lm_head and embedding), set around nn.Module's attribute hook
    so that it is neither a parameter nor a child module: ``_target``."""

    label = "this"
    pairs_tokens = False
    context_keep: int | None = None

    def __init__(self, target, dtype, config=None, embedding: mx.array | None = None):
        """``embedding``: the drafter's own table (kept in its stored dtype, rows cast on
        use), None when it borrows the target's."""
        super().__init__()
        if config is not None:
            self.config = config
        self.dtype = dtype
        if embedding is not None:
            self.embed_tokens = nn.Module()
            self.embed_tokens.weight = embedding
        object.__setattr__(self, "_target", target)
        self.gate_report = None

    def _embed(self, ids):
        """Token embeddings in the drafter's dtype: its own table if it keeps one (stored
        dtype, rows cast on use), else the target's."""
        if "embed_tokens" in self:
            return self.embed_tokens.weight[ids].astype(self.dtype)
        return self._target.embed(ids).astype(self.dtype)

    def shared_embedding(self) -> mx.array:
        """The borrowed embedding table (what the weight-load gate compares)."""
        return shared_embedding(self._target, target_dims(self._target)[1])

    @property
    def length(self) -> int:
        """Context tokens in the drafter's own cache."""
        return self._cache(None).length

    def add_context(self, taps: mx.array, start_pos: int, cache=None, tokens=None):
        """Commit taps ``[T, tap_width]`` of the tokens at positions start_pos.. to ``cache``
        (default: the drafter's own). A drafter that pairs each hidden state with the token
        after it (MTP, EAGLE-3) reads the T ``tokens``; the newest row waits in ``cache.last``
        until its token is known (the next call's first, or a proposal's bonus)."""
        cache = self._cache(cache)
        if start_pos != cache.length:
            raise ValueError(f"add_context at position {start_pos}, but the drafter's cache "
                             f"holds {cache.length} context tokens (contexts must be "
                             f"contiguous)")
        if taps.ndim != 2 or taps.shape[1] != self.tap_width:
            raise ValueError(f"taps must be [T, {self.tap_width}], got {tuple(taps.shape)}")
        if self.pairs_tokens and (tokens is None or len(tokens) != taps.shape[0]):
            raise ValueError("this drafter pairs each context row with the token after it: "
                             "pass the rows' tokens (tokens=)")
        end = start_pos + taps.shape[0]
        # Skip what no future query attends: a long prompt or serial stretch costs a window.
        keep = self.context_keep
        if keep and taps.shape[0] > keep:
            skip = taps.shape[0] - keep
            taps, start_pos = taps[skip:], start_pos + skip
            if self.pairs_tokens:               # the waiting row is older still
                tokens, cache.last = tokens[skip:], None
        rows, ids, pos0 = self.features(taps), None, start_pos
        if self.pairs_tokens:
            ids = mx.array(list(tokens), dtype=mx.int32)
            newest = rows[-1:]
            if cache.last is not None:
                rows, pos0 = mx.concatenate([cache.last, rows[:-1]]), start_pos - 1
            else:                               # the first token has no row before it
                rows, ids = rows[:-1], ids[1:]
            cache.last = newest
        if rows.shape[0]:
            self.context_rows(rows, ids, pos0, cache)
        cache.length = end                      # the skipped tokens count too

    def propose(self, bonus, n: int, draw: Draw | None = None, cache=None, **options):
        """Draft ``n`` tokens after ``bonus``, which sits at the position after ``cache``'s
        context (default: the drafter's own cache), each drawn as ``draw`` says
        (decode/draw.py; None: greedy). A caller using the drafter alone may give the draw's
        warping and noise as keywords instead (``temperature=``, ``top_p=``, ``top_k=``,
        ``vocab=``, ``min_p=``, ``noise=``, ``constraint=``: :meth:`Draw.of`).

        ``d_j = argmax(log warp(z_j) + noise[j-1])`` (``sampling.gumbel_max``): with Gumbel
        noise ``[n, V]`` a sample from the warped draft distribution, without (greedy) the
        argmax, never an id from ``vocab`` on. Returns lazy ``tokens [n]`` and ``logits [n,
        V]``: the logits each token was drawn from, after the processors and a grammar's mask
        (warp them with ``sampling.warp`` for the distribution)."""
        cache = self._cache(cache)
        if not 1 <= n <= self.max_draft:
            raise ValueError(f"n={n}: the {self.label} drafter drafts 1..{self.max_draft} "
                             f"tokens")
        if self.pairs_tokens and cache.last is None:
            raise ValueError("propose() before any context")
        if draw is not None and not isinstance(draw, Draw):
            raise TypeError(f"propose(bonus, n, draw): draw is a decode.draw.Draw, not "
                            f"{type(draw).__name__} (give the warping as keywords)")
        if draw is None or options:
            if draw is not None:
                raise TypeError("propose() takes a draw or its options as keywords, not both")
            draw = Draw.of(**options)
        return self.draft(mx.array(bonus, dtype=mx.int32).reshape(1), n, draw, cache)


# --------------------------------------------------------------------------------------------
# Loading


def target_dims(target) -> tuple:
    """``(hidden_size, vocab_size, num_hidden_layers)`` of a target (its config an object or a
    dict)."""
    c = target.config
    get = (lambda k: c.get(k)) if isinstance(c, dict) else (lambda k: getattr(c, k, None))
    return get("hidden_size"), get("vocab_size"), get("num_hidden_layers")


def draft_dtype(dtype, target) -> mx.Dtype:
    """The compute dtype a drafter loads in: ``dtype`` (an MLX dtype or its name,
    ``"bfloat16"``), or when None the target's (float32 when it has none)."""
    return compute_dtype(dtype if dtype is not None
                         else getattr(target, "dtype", None) or mx.float32)


def read_config(path: str) -> dict:
    """A directory's ``config.json``; DrafterError naming the file when it cannot be read."""
    cfg_file = os.path.join(path, "config.json")
    try:
        with open(cfg_file) as fh:
            return json.load(fh)
    except OSError as e:
        raise DrafterError(f"{cfg_file}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise DrafterError(f"{cfg_file}: not valid JSON ({e})") from None


def read_parsed(path: str, parse: Callable) -> tuple:
    """``(raw, config)`` of a converted drafter directory from its ``config.json`` alone,
    ``parse(raw, where)`` refusing what does not run or was built for another target."""
    cfg_file = os.path.join(path, "config.json")
    raw = read_config(path)
    if (raw.get("quantization") or {}).get("layout") != LAYOUT:
        raise DrafterError(f"{cfg_file}: not a converted checkpoint (no quantization.layout "
                           f"{LAYOUT!r}); run `mlx-dspark convert` on it first")
    try:
        return raw, parse(raw, cfg_file)
    except KeyError as e:
        raise DrafterError(f"{cfg_file}: missing field {e}") from None


def read_converted(path: str, verify: str, parse: Callable) -> tuple:
    """A converted drafter directory, read for loading: its ``config.json`` parsed by
    ``parse(raw, where)`` (which refuses the variants not implemented and a head built for
    another target), its files checked against the conversion receipt at the level ``verify``
    (checkpoint/integrity.py), its tensors read. Returns ``(raw, config, weights, origin)``."""
    raw, cfg = read_parsed(path, parse)
    weights, origin = read_weights(path, check_checkpoint(path, verify))
    return raw, cfg, weights, origin


def shares_embedding(weights: dict, target) -> bool:
    """Whether the drafter borrows the target's embedding: it has none of its own, or its own
    is bit-identical to the target's."""
    return ("embed_tokens.weight" not in weights
            or _embedding_identical(weights["embed_tokens.weight"], target))
