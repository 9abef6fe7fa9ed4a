"""Models named by Hugging Face repo id: converted on first use into a cache, reused after.

``load("nvidia/…")`` and ``--model nvidia/…`` work as in mlx-lm: the ModelOpt export is fetched
(converter/hub.py, at the pinned revision, else main), converted with the receipt and the
progress bar into ``$MLX_DSPARK_CACHE`` (default ``~/.cache/mlx-dspark``), and later loads use
that directory once its receipt confirms it came from the same repo and revision. A local
directory always wins over a repo id of the same spelling. Free of MLX."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

from ..converter.errors import ConversionError
from ..converter.hub import _REPO_ID
from ..converter.layout import RECEIPT_NAME, load_receipt
from ..converter.receipts import load_pins, pinned_revision


def cache_root() -> Path:
    return Path(os.environ.get("MLX_DSPARK_CACHE") or "~/.cache/mlx-dspark").expanduser()


def is_repo_id(name) -> bool:
    """A str (a Path is always a path) shaped like ``org/name`` that is not an existing path."""
    return isinstance(name, str) and bool(_REPO_ID.match(name)) \
        and not name.startswith(("./", "../", "~")) and not Path(name).expanduser().exists()


def resolve(name) -> Path:
    """The converted directory for ``name``: a local path as given, or a repo id's cache
    entry (converted now if absent). ``name`` that is neither is returned as a path for the
    loaders to report."""
    if not is_repo_id(name):
        return Path(name).expanduser()
    repo = name
    revision = pinned_revision(load_pins(), repo)
    out = cache_root() / f"{repo.replace('/', '--')}--{revision or 'main'}"
    if not out.exists():        # a conversion is renamed into place whole: absent or complete
        with _converting(out):
            if not out.exists():        # not converted by another process meanwhile
                from ..converter import convert
                print(f"mlx-dspark: first use of {repo}: converting it into {out} (later "
                      f"loads reuse it)", file=sys.stderr)
                convert(repo, out, revision=revision)
    _check_receipt(out, repo, revision)
    return out


@contextlib.contextmanager
def _converting(out: Path):
    """Hold the lock of cache entry ``out``: a second process resolving the same repo id
    waits here for the first one's conversion, then uses it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_receipt(out: Path, repo: str, revision: str | None) -> None:
    """The cache entry must be a conversion of ``repo`` (at ``revision`` when pinned)."""
    try:
        source = load_receipt(out)["source"]
        if not isinstance(source, dict):
            raise TypeError("source is not an object")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise ConversionError(f"{out}: cached conversion of {repo} has no readable "
                              f"{RECEIPT_NAME}; delete the directory to convert again") from None
    if source.get("repo_id") != repo or (revision and source.get("revision") != revision):
        raise ConversionError(f"{out}: its {RECEIPT_NAME} says it was converted from "
                              f"{source.get('repo_id')}@{source.get('revision')}, not "
                              f"{repo}@{revision or 'main'}; delete it to convert again")
