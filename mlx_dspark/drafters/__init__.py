"""The drafters: every kind registered once (:data:`KINDS`), and ``load_drafter``, the one
loader.

A kind is a module that defines a :class:`~.base.DrafterBase` and ``load(source, target, *,
dtype, verify, verbose, nvfp4)``, plus one line below: its name (``--drafter NAME``), the
``config.json`` architectures of its converted directories (none: the kind lives in the target's
own files, as ``mtp``), its loader, its embedded demo directory (``mlx_dspark/demo/…``) and
``fits(raw, where, target)``, its config parsed and fitted to a target before any weight is
read (:func:`check_pairing`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import dflash, dspark, eagle3, mtp
from .base import DrafterError


@dataclass(frozen=True)
class Kind:
    name: str
    architectures: tuple[str, ...]   # () : read from the target's own files, no directory
    load: Callable
    demo: str | None = None          # its embedded demo drafter, under DEMO
    fits: Callable | None = None     # (raw config, where, target): its config checked alone


KINDS = {kind.name: kind for kind in (
    Kind("dspark", dspark.ARCHITECTURES, dspark.load, demo="drafter", fits=dspark.fits),
    Kind("mtp", (), mtp.load),
    Kind("eagle3", eagle3.ARCHITECTURES, eagle3.load, demo="eagle3", fits=eagle3.fits),
    Kind("dflash", dflash.ARCHITECTURES, dflash.load, demo="dflash", fits=dflash.fits),
)}

NAMES = tuple(KINDS)
"""The drafter kinds ``--drafter`` and ``load(drafter=...)`` take by name."""

DEFAULT_DEMO = "dspark"
"""The demo drafter the embedded demo pair loads when none is named."""

DEMO = Path(__file__).parent.parent / "demo"
"""The embedded demo pair's home (api.DEMO): the demo target and the demo drafters."""


def of_target(source) -> bool:
    """Whether ``source`` names a kind read from the target's own files (``"mtp"``)."""
    kind = KINDS.get(str(source))
    return kind is not None and not kind.architectures


def locate(source, demo: Path | None = None):
    """What ``source`` names, before anything is read: a kind of the target's own stays its
    name; another kind's name is its embedded demo drafter under ``demo`` (the target is the
    demo target; with ``demo`` None, FileNotFoundError); anything else (a directory, a repo id)
    is returned as it is."""
    kind = KINDS.get(str(source))
    if kind is None or of_target(source):
        return source
    if demo is None:
        raise FileNotFoundError(f"--drafter {source} names the embedded demo drafter, which "
                                f"goes with the demo target only; pass the converted "
                                f"drafter's directory")
    path = Path(demo) / (kind.demo or kind.name)
    if not path.is_dir():
        raise FileNotFoundError(f"the demo {source} drafter is not shipped ({path} is "
                                f"missing); pass --model DIR --drafter DIR")
    return path


def kind_of(path: str) -> Kind:
    """The kind of a converted directory, by its config.json's ``architectures``;
    DrafterError otherwise."""
    from .base import read_config
    from .config import check_convention

    config = read_config(path)
    # first: such a config may name an architecture below, and must never be read as one
    check_convention(config, os.path.join(path, "config.json"))
    archs = config.get("architectures") or []
    for kind in KINDS.values():
        if set(archs) & set(kind.architectures):
            return kind
    known = "; ".join(f"{k.name}: {' or '.join(k.architectures)}" if k.architectures else
                      f"the target's own block: --drafter {k.name}" for k in KINDS.values())
    raise DrafterError(f"{os.path.join(path, 'config.json')}: architectures {archs} is no "
                       f"drafter this runtime runs ({known})")


def check_pairing(source, target_config) -> None:
    """What :func:`load_drafter` refuses of the drafter ``source`` (a converted directory)
    from the config files alone (``target_config``: the target's, a TargetConfig): a kind
    this runtime does not run, an unconverted directory, a drafter built for another target.
    Run before any weight of either is read (a wrong drafter is named at once, not after the
    target's weights load); the target's own block (``"mtp"``) has nothing to pair."""
    from types import SimpleNamespace

    from .base import read_parsed

    if of_target(source):
        return
    kind = kind_of(str(source))
    target = SimpleNamespace(config=target_config)
    read_parsed(str(source), lambda raw, where: kind.fits(raw, where, target))


def load_drafter(source, target, *, dtype=None, verify: str = "auto", verbose: bool = False,
                 nvfp4: str | None = None):
    """The drafter ``source`` names for ``target``, passed through the weight-load gate:
    a kind's name (``"mtp"``: the target's own block; ``"dspark"``, ``"eagle3"``, ``"dflash"``: the embedded
    demo drafters, on the demo target), or a converted directory (its kind by config.json).

    ``dtype``: the compute dtype or its name (``"bfloat16"``; None: the target's). ``verify``:
    how much of the files is checked against the conversion receipt first
    (checkpoint/integrity.py). ``nvfp4``: the NVFP4 compute path (quant.nvfp4_policy when
    None)."""
    path = getattr(target, "path", None)
    demo = DEMO if path is not None and Path(path).resolve() == (DEMO / "target").resolve() \
        else None
    source = locate(source, demo)
    fmt = getattr(target, "format", None)
    if of_target(source) and fmt is not None and fmt.layout == "mlx-lm":
        raise DrafterError(f"{path}: --drafter {source} reads NVIDIA's MTP block, which this "
                           f"checkpoint ({fmt}) does not hold (mlx_lm.convert drops mtp.*): "
                           f"use a DSpark or EAGLE-3 drafter, or NVIDIA's export of this "
                           f"model as --model")
    kind = KINDS[source] if of_target(source) else kind_of(str(source))
    return kind.load(str(source), target, dtype=dtype, verify=verify, verbose=verbose,
                     nvfp4=nvfp4)
