"""The converted-checkpoint contract (ARCHITECTURE.md, "Converted checkpoint layout"): what the
converter writes and the runtime reads. One owner, so the two cannot drift apart.

MLX-free (the converter and ``mlx-dspark --help`` import it)."""

from __future__ import annotations

import glob
import json
import os

LAYOUT = "mlx-dspark/1"
"""``config.json``'s ``quantization.layout`` in every converted directory."""

GROUP_SIZE = 16
"""NVFP4 block size: one E4M3 scale per 16 weights."""

RECEIPT_NAME = "MERERUN_CONVERSION.json"
"""The converter's receipt beside the weights (sha256 and size of every output file)."""

BLOCK_CHARS = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*",
               "full_attention": "*", "mlp": "-"}
"""transformers-5 ``layers_block_type`` names -> Nemotron-H ``hybrid_override_pattern``
characters (Mamba-2, MoE, attention, dense MLP)."""


def layer_pattern(kinds) -> str:
    """The ``hybrid_override_pattern`` spelled by a ``layers_block_type`` list; ValueError when
    an entry is no block kind."""
    try:
        return "".join(BLOCK_CHARS[k] for k in kinds)
    except (KeyError, TypeError):
        raise ValueError(f"unknown entry in layers_block_type {kinds!r}") from None


def decode_float(v) -> float:
    """A config number, including ModelOpt's ``{"__float__": "Infinity"}`` for non-finite ones."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        try:
            return float(v["__float__"])
        except (TypeError, ValueError):
            raise ValueError(f"bad __float__ value {v['__float__']!r}") from None
    return float(v)


def weight_files(path: str) -> list[str]:
    """The converted directory's weight files, in the order they are read."""
    return sorted(glob.glob(os.path.join(path, "model*.safetensors")))


def read_receipt(path: str) -> dict | None:
    """The receipt's ``outputs`` (file name -> {"sha256", "size"}), or None when the directory
    has no receipt. Raises ValueError/OSError/KeyError/TypeError on an unreadable one."""
    receipt = os.path.join(path, RECEIPT_NAME)
    if not os.path.exists(receipt):
        return None
    with open(receipt) as fh:
        return json.load(fh)["outputs"]
