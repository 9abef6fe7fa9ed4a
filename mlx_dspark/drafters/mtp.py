"""The target's own multi-token-prediction block (NVIDIA's ``mtp.*``) as a drafter.

Built from the target's config as vLLM's and SGLang's ``nemotron_h_mtp`` define it: the layer
pattern ``mtp_hybrid_override_pattern`` (or ``mtp_layers_block_type``), repeated
``num_nextn_predict_layers`` times (NVIDIA ships one step), of attention (``*``) and MoE
(``E``) layers of the target's own kinds, each ``x + mixer(RMSNorm(x))``. The first layer
fuses its inputs, the last one normalizes its output:

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])       the next token with the hidden state
    x = x + mixer_l(norm_l(x))                              for each layer of the pattern
    out_p = final_layernorm(x);  logits = lm_head(out_p)    the prediction of t_{p+2}

``h_p`` is the target's hidden state at position ``p`` as vLLM hands it over: the output of
its last layer after ``norm_f`` (the tap of the last layer, normalized here). The embedding
and the lm_head are the target's (shared, never copied). Drafting more tokens reuses the
block on its own output, as vLLM does: ``out_p`` becomes the hidden state of the next step.

Each context row pairs a position's hidden state with the token after it, so the newest
context row waits (``MTPCache.last``) until that token is known: the bonus of a proposal, or
the first token of the next ``add_context``. Only ``add_context`` (committed tokens, the
target's hidden states) writes the cache; a proposal's own rows are scratch, rewound before it
returns, so rejected drafts never reach the next round.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.integrity import check_level
from ..checkpoint.recorded import check_files
from ..converter.layout import mtp_pattern
from ..kernels.norm import rms_norm
from ..models.cache import KVCache
from ..models.layers import Norm
from ..models.nemotron_h import Attention, MoE, stack_experts
from ..models.quant import Weights
from ..models.weights import CheckpointError, read_weights, through_gate
from .base import DrafterBase, Draw, draft_dtype

PREFIX = "mtp."
MAX_DRAFT = 16
"""Most tokens one proposal drafts. The block has no limit of its own (each draft reuses it);
its acceptance decays with every reuse, so more than this would be waste."""


class MTPLayer(nn.Module):
    """One layer of the pattern; parameter names mirror ``mtp.layers.{i}.*`` (for the gate)."""

    def __init__(self, kind: str, cfg, w: Weights, i: int, first: bool, last: bool):
        super().__init__()
        p, eps = f"mtp.layers.{i}", cfg.layer_norm_epsilon
        self.kind = kind
        if first:
            self.enorm = Norm(w.cast(f"{p}.enorm.weight"), eps)
            self.hnorm = Norm(w.cast(f"{p}.hnorm.weight"), eps)
            self.eh_proj = w.linear(f"{p}.eh_proj")
        self.norm = Norm(w.cast(f"{p}.norm.weight"), eps)
        self.mixer = Attention(cfg, w, f"{p}.mixer") if kind == "*" else MoE(cfg, w, f"{p}.mixer")
        if last:
            self.final_layernorm = Norm(w.cast(f"{p}.final_layernorm.weight"), eps)

    def __call__(self, x, cache: KVCache | None):
        h = self.norm(x)
        return x + (self.mixer(h, cache) if self.kind == "*" else self.mixer(h))


class MTPDrafter(DrafterBase):
    label = "MTP"
    pairs_tokens = True         # a context row is a hidden state and the token after it
    max_draft = MAX_DRAFT
    context_keep = None         # its attention is global: every context row stays

    def __init__(self, target, w: dict, pattern: str, dtype=None, nvfp4: str | None = None):
        super().__init__(target, draft_dtype(dtype, target))   # its embedding, norm_f, lm_head
        cfg = target.config
        w = Weights(w, self.dtype, nvfp4)
        n = len(pattern)
        self.layers = [MTPLayer(c, cfg, w, i, i == 0, i == n - 1) for i, c in enumerate(pattern)]
        self.pattern = pattern

    @property
    def target_layer_ids(self) -> list[int]:
        return [self._target.config.num_hidden_layers - 1]

    @property
    def tap_width(self) -> int:
        return self._target.config.hidden_size

    def make_cache(self, start: int = 0) -> "MTPCache":
        cache = MTPCache(self.pattern)
        cache.length = start
        return cache

    def features(self, taps):
        """The target's hidden states as vLLM hands them to the block: after ``norm_f``."""
        t = self._target
        return rms_norm(taps.astype(self.dtype), t.norm_f, t.config.layer_norm_epsilon)

    def block(self, ids, hidden, cache: "MTPCache"):
        """``out [T, hidden]`` of the block over rows (token ``ids [T]``, ``hidden [T, H]``);
        its attention layers append the rows to ``cache``."""
        e = self._embed(ids)
        first = self.layers[0]
        x = first.eh_proj(mx.concatenate([first.enorm(e), first.hnorm(hidden)], axis=-1))[None]
        for layer, kv in zip(self.layers, cache.layers):
            x = layer(x, kv)
        return self.layers[-1].final_layernorm(x[0])

    def context_rows(self, rows, ids, pos0: int, cache: "MTPCache"):
        self.block(ids, rows, cache)        # only the attention K/V it leaves matter

    def draft(self, bonus, n: int, draw: Draw, cache: "MTPCache"):
        """The block reused on its own output, from the newest context row: each draft's
        ``out`` is the next one's hidden state. Its rows are scratch, rewound after."""
        marks = [kv.offset if kv is not None else None for kv in cache.layers]
        hidden = cache.last

        def row(j, prev):
            nonlocal hidden
            hidden = self.block(prev, hidden, cache)
            return self._target.lm_head(hidden).astype(mx.float32)

        out = draw.chain(row, bonus, n)
        for kv, mark in zip(cache.layers, marks):    # the drafts' own rows are scratch
            if kv is not None:
                kv.offset = mark
        return out


class MTPCache:
    """The block's context: per attention layer the K/V of the committed rows (a KVCache
    whose rows past ``offset`` are a proposal's scratch), the hidden state of the newest
    context token (``last``, waiting for the token after it), and ``length``, the context
    tokens seen."""

    def __init__(self, pattern: str):
        self.layers = [KVCache() if c == "*" else None for c in pattern]
        self.last = None
        self.length = 0

    def snapshot(self):
        """The K/V copied (their buffers are written in place), the rest shared."""
        kv = tuple(None if c is None or c.keys is None else
                   tuple(mx.contiguous(x) for x in c.state()) for c in self.layers)
        return self.length, self.last, kv

    def restore(self, state):
        self.length, self.last, kv = state
        for i, s in enumerate(kv):
            if self.layers[i] is not None:
                self.layers[i] = KVCache()
                if s is not None:
                    self.layers[i].update(*s)   # into a fresh buffer: the snapshot stays valid

    def arrays(self) -> list[mx.array]:
        out = [] if self.last is None else [self.last]
        for c in self.layers:
            if c is not None and c.keys is not None:
                out += list(c.state())
        return out


def load(source: str, target, *, dtype=None, verify: str = "auto", verbose: bool = False,
         nvfp4: str | None = None) -> MTPDrafter:
    """The MTP block of ``target`` (``source``: ``"mtp"``), read from the target's own files
    (``load_target`` remembers its directory, and checked them against the receipt at its own
    ``verify`` level: this one is only validated) and passed through the weight-load gate.
    ``dtype``, ``nvfp4``: as for the other drafters (None: the target's dtype, quant's
    policy)."""
    check_level(verify)
    dtype = draft_dtype(dtype, target)
    path = getattr(target, "path", None)
    if path is None:
        raise CheckpointError("--drafter mtp: the target was not loaded from a directory "
                              "(load_target), so there is no MTP block to read")
    cfg = target.config
    raw = dict(cfg.extra, num_hidden_layers=cfg.num_hidden_layers)
    try:
        pattern = mtp_pattern(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    if not pattern:
        raise CheckpointError(f"{path}/config.json: the target declares no MTP block "
                              f"(num_nextn_predict_layers "
                              f"{raw.get('num_nextn_predict_layers', 0)}); --drafter mtp "
                              f"needs one")
    if set(pattern) - set("*E"):
        raise CheckpointError(f"{path}/config.json: MTP layer pattern {pattern!r}: only "
                              f"attention (*) and MoE (E) layers are implemented")
    layout = getattr(getattr(target, "format", None), "layout", None)
    reads = check_files(path, verify, require_receipt=layout == "mlx-dspark")
    w = read_weights(path, reads, keep=lambda name: name.startswith(PREFIX))[0]
    if not w:
        raise CheckpointError(f"{path}: converted without its MTP block (mtp.* tensors); "
                              f"convert again without --no-mtp for --drafter mtp")
    w = stack_experts(w, len(pattern), "mtp.layers")
    try:
        drafter = MTPDrafter(target, w, pattern, dtype, nvfp4)
    except KeyError as e:
        raise CheckpointError(f"{path}: tensor {e.args[0]} missing from the MTP block "
                              f"(pattern {pattern!r})") from None
    del w
    return through_gate(drafter, path, verbose, PREFIX)
