"""The drafter a target gets when none is named: NVIDIA's DSpark drafter for the target it was
trained with, recognised by the target's config (its shape), never by its name, so that an
mlx-lm conversion of Lightning, a local copy or a renamed upload gets it too. The drafter is
the converted one in the local cache when there is one, else its repo id (fetched and converted
on first use, checkpoint/hub.py) unless the hub is offline. MLX-free."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from ..converter.layout import layer_pattern
from .hub import cache_entry, resolve

LIGHTNING_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
"""NVIDIA Nemotron 3.5 Lightning 30B-A3B's 52 layers (docs/design.md §5)."""


@dataclass(frozen=True)
class Known:
    """A target and its drafter: ``shape`` is the config fields that identify the target."""
    name: str
    drafter: str
    shape: dict


KNOWN = [
    Known("Nemotron 3.5 Lightning 30B-A3B",
          "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DSpark",
          {"hidden_size": 2688, "vocab_size": 131072, "hybrid_override_pattern": LIGHTNING_PATTERN,
           "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
           "mamba_num_heads": 64, "num_attention_heads": 32, "num_key_value_heads": 2}),
]


class Choice(NamedTuple):
    """The drafter to load (a repo id; None: serial decoding) and why, in the banner's words."""
    drafter: str | None
    why: str


def _pattern(config: dict) -> str | None:
    pattern = config.get("hybrid_override_pattern")
    if pattern is None and isinstance(config.get("layers_block_type"), list):
        try:
            pattern = layer_pattern(config["layers_block_type"])
        except ValueError:
            return None
    return "".join(pattern) if isinstance(pattern, (str, list)) else None


def known_target(config: dict) -> Known | None:
    """The known target ``config`` describes (by every field of its shape), or None."""
    fields = {**config, "hybrid_override_pattern": _pattern(config)}
    for known in KNOWN:
        if all(fields.get(k) == v for k, v in known.shape.items()):
            return known
    return None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def default_drafter(config: dict) -> Choice:
    """What ``--model`` without ``--drafter`` speculates with."""
    known = known_target(config)
    if known is None:
        return Choice(None, "no --drafter given, and none is known for this model's config")
    if cache_entry(known.drafter).exists():
        return Choice(known.drafter, f"the default for {known.name}, from the local cache")
    if offline():
        return Choice(None, f"{known.name}'s DSpark drafter {known.drafter} is not in the local "
                            f"cache and the hub is offline (HF_HUB_OFFLINE)")
    return Choice(known.drafter, f"the default for {known.name}, fetched by its repo id")


def resolve_default(config: dict) -> Choice:
    """:func:`default_drafter` made a directory (its cache entry, converted now on first use);
    a drafter that cannot be fetched leaves the target serial, with the reason."""
    from ..converter.errors import ConversionError
    choice = default_drafter(config)
    if choice.drafter is None:
        return choice
    try:
        return Choice(str(resolve(choice.drafter, "drafter")), choice.why)
    except (ConversionError, OSError, ValueError) as e:
        return Choice(None, f"its default drafter {choice.drafter} could not be fetched: "
                            f"{' '.join(str(e).split())}")
