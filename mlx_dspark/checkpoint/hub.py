"""Models named by Hugging Face repo id: converted on first use into a cache, reused after.

``load("nvidia/…")`` and ``--model nvidia/…`` work as in mlx-lm. The repo's small files come
first (config.json, the safetensors index: format, architecture and size, checked before any
large download); a model already in MLX layout (mlx-lm's conversions) is downloaded into
huggingface_hub's cache and loads as it is; anything else is fetched (converter/hub.py, at the
pinned revision, else main), converted with the receipt and the progress bar into
``$MLX_DSPARK_CACHE`` (default ``~/.cache/mlx-dspark``), and later loads use that directory
once its receipt confirms it came from the same repo and revision. A local directory always
wins over a repo id of the same spelling. Free of MLX."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

from ..converter import hub
from ..converter.errors import ConversionError
from ..converter.hub import _REPO_ID
from ..converter.layout import LAYOUT, RECEIPT_NAME, load_receipt
from ..converter.omni import tower_name, wrapper_name
from ..converter.quant_config import load_json
from ..converter.receipts import load_pins, pinned_revision
from .formats import check_target_config, detect, detect_dir


def cache_root() -> Path:
    return Path(os.environ.get("MLX_DSPARK_CACHE") or "~/.cache/mlx-dspark").expanduser()


def is_repo_id(name) -> bool:
    """A str (a Path is always a path) shaped like ``org/name`` that is not an existing path."""
    return isinstance(name, str) and bool(_REPO_ID.match(name)) \
        and not name.startswith(("./", "../", "~")) and not Path(name).expanduser().exists()


def cache_entry(repo: str) -> Path:
    """Where the conversion of ``repo`` (at its pinned revision, else main) lives."""
    revision = pinned_revision(load_pins(), repo)
    return cache_root() / f"{repo.replace('/', '--')}--{revision or 'main'}"


def resolve(name, kind: str | None = None, fits=None) -> Path:
    """The directory for ``name``: a local path as given; for a repo id, its cache entry
    (converted now if absent) or, for a model already in MLX layout (mlx-lm's), its download
    in huggingface_hub's cache, loaded as it is. Before any large download the repo's small
    files (checkpoint/formats.py) refuse what cannot run, and ``fits(total bytes, repo)`` may
    refuse a model too large for the device. ``kind``: "model" (refused unless a Nemotron-H
    target), "drafter", or None (either). ``name`` that is neither a path nor a repo id is
    returned as a path for the loaders to report."""
    if not is_repo_id(name):
        return Path(name).expanduser()
    repo = name
    revision = pinned_revision(load_pins(), repo)
    out = cache_entry(repo)
    if not out.exists():        # a conversion is renamed into place whole: absent or complete
        local = hub.cached_snapshot(repo, revision)
        if local is not None and _loads_as_is(local, kind):
            return local
        print(f"mlx-dspark: first use of {repo}: reading its config.json and safetensors index "
              f"first", file=sys.stderr)
        fmt, size = _precheck(repo, revision, kind)
        if fits is not None and size:
            fits(size, repo)
        what = f"{fmt}, " if fmt else ""
        what += f"{size / 1e9:.1f} GB of weights" if size else "size not in its index"
        if fmt is not None and fmt.layout in AS_IS:
            print(f"mlx-dspark: {repo}: {what}: downloading it (it loads as it is)",
                  file=sys.stderr)
            return Path(hub._snapshot_download(repo, revision))
        with _converting(out):
            if not out.exists():        # not converted by another process meanwhile
                from ..converter import convert
                print(f"mlx-dspark: {repo}: {what}: converting it into {out} (later loads "
                      f"reuse it)", file=sys.stderr)
                convert(repo, out, revision=revision)
    _check_receipt(out, repo, revision)
    return out


AS_IS = ("mlx-lm", "mlx-dspark")
"""Layouts a repo id is downloaded in and loaded as they are (the others are converted)."""


def _precheck(repo: str, revision: str | None, kind: str):
    """(the model's Format, or None for a drafter; its weights' bytes, or None) from the
    repo's small files; a one-line error for what cannot run."""
    info = hub.inspect_repo(repo, revision)
    where = f"{repo}@{revision or 'main'}"
    config = info.config
    if kind == "model":
        config = check_target_config(config, where)       # an Omni wrapper: its text tower's
    elif info.kind != "target":
        if info.kind is None:
            from ..converter.plan import detect_kind
            detect_kind(info.config, info.names, Path(where))          # raises: why not
        return None, info.size
    names = info.names
    if wrapper_name(info.config) is not None:
        names = {tower_name(n): d for n, d in names.items() if tower_name(n) is not None}
    return detect(config, names, where, info.hf_quant_config), info.size


def _loads_as_is(local: Path, kind: str | None) -> bool:
    """A snapshot already in huggingface_hub's cache that loads without converting."""
    try:
        config = load_json(local / "config.json")
        if (config.get("quantization") or {}).get("layout") == LAYOUT:
            return True
        return kind != "drafter" and detect_dir(
            local, check_target_config(config, local)).layout == "mlx-lm"
    except (OSError, ValueError, ConversionError, AttributeError):
        return False        # the precheck and the loaders say what is wrong with it


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
