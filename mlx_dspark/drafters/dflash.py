"""z-lab's DFlash drafter (``DFlashDraftModel``, the layout of NVIDIA's
``NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DFlash``) over the converted checkpoint layout.

One drafting round, with ``P`` = number of context tokens and ``B`` the configured block:

1. Context injection, as DSpark's (drafters/dspark.py, the backbone both share): the taps of the
   configured target layers, concatenated, give ``c_p = hidden_norm(fc(taps_p))``; each layer
   keeps ``K = RoPE_p(k_norm(W_k c_p))`` and ``V = W_v c_p`` of the keys a query can still see.
2. The block ``[bonus, mask x (B-1)]`` at positions ``P..P+B-1``, embedded with the target's
   embedding (times ``input_embedding_scale``), runs once through the Qwen3 layers against the
   context keys and its own keys. Within the block attention is **non-causal**: every row sees
   every row (within the sliding window on both sides, on a sliding layer), except on layers
   z-lab makes causal (``is_causal``; when unset, its sliding layers).
3. Rows ``1..B-1`` go through the final norm and the *target's* lm_head (times
   ``output_multiplier``, then the ``final_logit_softcapping`` tanh cap when set): ``z_j``.

A row depends on every mask row of the block, so the whole block always runs and ``propose(n)``
returns its first ``n`` drafts (the loop verifies a prefix of the same block, whatever ``n``).
No draft reads the one before it: each is drawn from its own row by the one draw chain
(decode/draw.py's Draw: the processors, the grammar's mask, the warp, Gumbel-max), so the distributions the loop's
rejection sampling reads are the ones the drafts were drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..converter.shapes import check_drafter
from .base import DrafterError, Draw
from .config import DrafterConfig, _pick, _unsupported, backbone_fields, check_convention
from .dspark import BlockDrafter, fitted, load_block

ARCHITECTURES = ("DFlashDraftModel",)
BLOCK_SIZE = 16          # z-lab's default when a config names none


@dataclass(frozen=True)
class DFlashConfig(DrafterConfig):
    causal: tuple = ()              # per layer: whether a block row sees only rows before it
    input_scale: float = 1.0        # input_embedding_scale
    output_scale: float = 1.0       # output_multiplier
    softcap: float | None = None    # final_logit_softcapping


def parse_config(cfg: dict, where: str = "config.json") -> DFlashConfig:
    """Parse a DFlash ``config.json`` (z-lab's fields; NVIDIA writes some in
    ``dflash_config`` too); refuse the variants this runtime does not implement."""
    check_convention(cfg, where)
    archs = cfg.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
        _unsupported(where, f"architectures {archs} (expected DFlashDraftModel)")
    if any(k in cfg or k in (cfg.get("dflash_config") or {}) for k in
           ("markov_rank", "dspark_markov_rank", "dspark_fixup_head_type")):
        _unsupported(where, "a Markov head (dspark_* fields): a DSpark drafter, whose converted "
                            "config names Qwen3DSparkModel")
    for key, what in (("conv_kernel_size", "DFlash2's dynamic convolutions"),
                      ("selector_rank", "DFlash2's candidate selector")):
        if _pick(cfg, [key], where) is not None:
            _unsupported(where, f"{key} ({what})")
    if cfg.get("hidden_act", "silu") != "silu":
        _unsupported(where, f"hidden_act {cfg['hidden_act']!r} (SwiGLU with silu only)")
    if cfg.get("attention_bias", False):
        _unsupported(where, "attention_bias=true (projections with a bias)")
    if cfg.get("has_lm_head", False):
        _unsupported(where, "has_lm_head=true (own lm_head; DFlash uses the target's)")
    check_drafter(cfg, where)
    vocab = int(cfg["vocab_size"])
    if cfg.get("draft_vocab_size") not in (None, vocab):
        _unsupported(where, f"draft_vocab_size {cfg['draft_vocab_size']} != vocab_size "
                            f"{vocab} (reduced draft vocabulary)")
    fields = backbone_fields(cfg, where, block_default=BLOCK_SIZE)
    # z-lab: an explicit is_causal holds for every layer; unset, sliding layers are causal.
    causal = _pick(cfg, ["is_causal", "causal", "dflash_query_causal"], where)
    per_layer = tuple(bool(causal) if causal is not None else w is not None
                      for w in fields["windows"])
    softcap = _pick(cfg, ["final_logit_softcapping"], where)
    scales = {}
    for name in ("input_embedding_scale", "output_multiplier"):
        scales[name] = float(_pick(cfg, [name], where, 1.0))
        if not math.isfinite(scales[name]):
            raise DrafterError(f"{where}: {name} {scales[name]} is not finite")
    return DFlashConfig(**fields, markov_rank=0, has_embed_tokens=False, causal=per_layer,
                        input_scale=scales["input_embedding_scale"],
                        output_scale=scales["output_multiplier"],
                        softcap=float(softcap) if softcap and float(softcap) > 0 else None)


class DFlashDrafter(BlockDrafter):
    """Parameter names mirror the checkpoint's tensor names (the weight-load gate relies on it)."""

    label = "DFlash"
    optional_embedding = True

    def causal(self, i: int) -> bool:
        return self.config.causal[i]

    def block_input(self, ids) -> mx.array:
        x = self._embed(ids)
        scale = self.config.input_scale
        return x if scale == 1.0 else x * mx.array(scale, dtype=x.dtype)

    def block_logits(self, bonus, cache=None) -> mx.array:
        """``z [B-1, V]``: every mask row of the block through the target's lm_head, scaled and
        capped as configured (float32)."""
        cfg = self.config
        z = self._target.lm_head(self.block_hidden(bonus, self.max_draft, cache))
        z = z.astype(mx.float32)
        if cfg.output_scale != 1.0:
            z = z * cfg.output_scale
        if cfg.softcap is not None:
            z = mx.tanh(z / cfg.softcap) * cfg.softcap
        return z

    def draft(self, bonus, n: int, draw: Draw, cache):
        """The first ``n`` rows of the block, each drawn by the draw chain from its own row."""
        z = self.block_logits(bonus, cache)
        return draw.chain(lambda j, prev: z[j:j + 1], bonus, n)


def fits(raw: dict, where: str, target) -> DFlashConfig:
    """The DFlash config ``raw`` parsed and fitted to ``target``, before any weight is read."""
    return fitted(parse_config, raw, where, target)


def load(source: str, target, *, dtype=None, verify: str = "auto", verbose: bool = False,
         nvfp4: str | None = None) -> DFlashDrafter:
    """Load the converted DFlash drafter in the directory ``source`` for ``target`` and pass it
    through the weight-load gate (the arguments as for dspark.load). The drafter borrows the
    target's lm_head, and its embedding unless the checkpoint has one of its own that differs
    (z-lab's has none)."""
    return load_block(DFlashDrafter, fits, "z-lab's DFlash layout", source, target,
                      dtype=dtype, verify=verify, verbose=verbose, nvfp4=nvfp4)
