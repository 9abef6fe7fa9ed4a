"""Resolve SRC: a local directory, or a Hugging Face repo id fetched at the pinned revision."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError
from .receipts import pinned_revision

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What conversion reads; skips e.g. PyTorch .bin duplicates and images.
FETCH_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class Source:
    path: Path
    repo_id: str | None
    revision: str | None


def _from_hf_cache(path: Path) -> tuple[str | None, str | None]:
    """``.../models--org--name/snapshots/<commit>`` -> ("org/name", commit)."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/"), path.name
    return None, None


def resolve_source(src: str, revision: str | None, pins: dict,
                   repo_id: str | None = None) -> Source:
    """A directory is used in place (an HF cache snapshot also names its repo and revision);
    a repo id is fetched with huggingface_hub into the normal cache, at ``revision``, else
    the pinned revision, else main."""
    path = Path(src).expanduser()
    if path.is_dir():
        path = path.resolve()
        cached_repo, cached_rev = _from_hf_cache(path)
        if repo_id and cached_repo and repo_id != cached_repo:
            raise ConversionError(f"{path}: --repo-id {repo_id} but this is a cache of {cached_repo}")
        if revision and cached_rev and revision != cached_rev:
            raise ConversionError(f"{path}: --revision {revision} but this snapshot is {cached_rev}")
        return Source(path, repo_id or cached_repo, revision or cached_rev)
    if path.exists():
        raise ConversionError(f"{src}: not a directory")
    if not _REPO_ID.match(src) or src.startswith(("./", "../", "~")):
        raise ConversionError(f"{src}: missing file: no such directory (nor a Hugging Face repo id)")
    if repo_id and repo_id != src:
        raise ConversionError(f"{src}: --repo-id {repo_id} contradicts the repo id given as SRC")
    rev = revision or pinned_revision(pins, src)
    local = Path(_snapshot_download(src, rev))
    _, fetched = _from_hf_cache(local)
    return Source(local, src, fetched or rev)


def _snapshot_download(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=FETCH_PATTERNS)
    except Exception as e:       # network, auth, missing repo/revision: all one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{repo_id}@{revision or 'main'}: download failed ({first})") from None
