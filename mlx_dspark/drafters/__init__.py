"""Which drafter a name or a directory is. ``"mtp"`` is the target's own MTP block (drafters/mtp.py); a
converted directory is a DSpark drafter (drafters/dspark.py) or an EAGLE-3 head (drafters/eagle3.py) by its
``config.json``'s ``architectures``; anything else is refused by name."""

from __future__ import annotations

import os

from .config import DrafterError

NAMES = ("dspark", "mtp", "eagle3")
"""The drafter kinds ``--drafter`` and ``load(drafter=...)`` take by name."""

DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)


def kind_of(path: str) -> str:
    """``"dspark"`` or ``"eagle3"`` from the directory's config.json; DrafterError otherwise."""
    from .eagle3 import ARCHITECTURES, read_config

    archs = read_config(path).get("architectures") or []
    if set(archs) & set(DSPARK_ARCHITECTURES):
        return "dspark"
    if set(archs) & set(ARCHITECTURES):
        return "eagle3"
    raise DrafterError(f"{os.path.join(path, 'config.json')}: architectures {archs} is no "
                       f"drafter this runtime runs (DSpark: {DSPARK_ARCHITECTURES[0]}; "
                       f"EAGLE-3: {' or '.join(ARCHITECTURES)}; the target's own block: "
                       f"--drafter mtp)")


def load_drafter(path, target, dtype=None, nvfp4: str | None = None, verbose: bool = False,
                 verify: str = "auto"):
    """The drafter ``path`` names for ``target``: ``"mtp"``, or a converted DSpark or EAGLE-3
    directory, passed through the weight-load gate."""
    if str(path) == "mtp":
        from .mtp import load_mtp
        return load_mtp(target, verbose=verbose)
    path = str(path)
    if kind_of(path) == "eagle3":
        from .eagle3 import load_eagle3
        return load_eagle3(path, target, dtype=dtype, verify=verify, verbose=verbose)
    from .dspark import load_drafter as load_dspark
    return load_dspark(path, target, dtype=dtype, nvfp4=nvfp4, verbose=verbose, verify=verify)
