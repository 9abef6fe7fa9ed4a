"""Resolve SRC: a local directory, or a Hugging Face repo id fetched at the pinned revision."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError
from .mlx_layouts import mlx_layout
from .quant_config import check_quant_method
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
    info = inspect_repo(src, rev)
    if info.kind is None:
        from .plan import detect_kind
        detect_kind(info.config, info.names, Path(f"{src}@{rev or 'main'}"))   # raises: why
    check_quant_method(info.config, f"{src}@{rev or 'main'}")
    mlx = mlx_layout(info.config, info.names)
    if mlx is not None:
        raise ConversionError(f"{src}: already in MLX layout ({mlx}): it loads as it is "
                              f"(--model {src}); nothing to convert, nothing downloaded")
    local = Path(_snapshot_download(src, rev))
    _, fetched = _from_hf_cache(local)
    return Source(local, src, fetched or rev)


@dataclass(frozen=True)
class RepoInfo:
    """What a repo's small files say: its config, tensor names (from the safetensors index;
    name -> None, dtypes unknown), the weights' total size when the index states it, whether
    it has ModelOpt's hf_quant_config.json, and the model kind (plan.py's; None: none)."""
    config: dict
    names: dict
    size: int | None
    hf_quant_config: bool
    kind: str


def inspect_repo(repo_id: str, revision: str | None) -> RepoInfo:
    """Read a repo's ``config.json`` and safetensors index (and ``hf_quant_config.json``)
    only: its format, architecture and size are known before any weight is downloaded."""
    from .plan import _weight_map, detect_kind
    from .quant_config import load_json

    where = f"{repo_id}@{revision or 'main'}"
    offline = not _reachable(repo_id, revision)
    cfg = _small_file(repo_id, "config.json", revision, required=True, offline=offline)
    if cfg is None:
        raise ConversionError(f"{where}: no config.json, so not a Hugging Face checkpoint in "
                              f"safetensors (a GGUF repo runs with llama.cpp); mlx-dspark needs "
                              f"the model's safetensors release")
    config = load_json(cfg)
    if not isinstance(config, dict):
        raise ConversionError(f"{where}: config.json is not a JSON object")
    index = _small_file(repo_id, "model.safetensors.index.json", revision, offline=offline)
    names, size = {}, None
    if index is not None:
        names = dict.fromkeys(_weight_map(index))
        total = (load_json(index).get("metadata") or {}).get("total_size")
        size = total if isinstance(total, int) else None
    hfq = _small_file(repo_id, "hf_quant_config.json", revision, offline=offline) is not None
    try:
        kind = detect_kind(config, names, Path(where))
    except ConversionError:
        kind = None                   # no model the converter knows: its callers say so
    return RepoInfo(config, names, size, hfq, kind)


def _reachable(repo_id: str, revision: str | None) -> bool:
    """Whether the Hub answers for the repo: one request, no retries. A missing, mistyped or
    gated repo (or revision) is refused here in one line; False when offline (HF_HUB_OFFLINE,
    or no connection), so that only the local cache is read: huggingface_hub would retry an
    unreachable Hub for every file the cache lacks (about 23 s each)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
    from huggingface_hub.file_download import get_hf_file_metadata
    if constants.is_offline_mode():
        return False
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision), timeout=10)
    except EntryNotFoundError:
        return True             # a repo without config.json: inspect_repo says what it is
    except HfHubHTTPError as e:
        _failed(repo_id, revision, e)
    except Exception:           # no connection, DNS, timeout: the cache may still hold it
        return False
    return True


def _small_file(repo_id: str, name: str, revision: str | None,
                required: bool = False, offline: bool = False) -> Path | None:
    """One small file of the repo (through huggingface_hub's cache; ``offline``: from the
    cache alone), None when the repo has none (or, offline, the cache lacks an optional one)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError
    try:
        return Path(hf_hub_download(repo_id, name, revision=revision, local_files_only=offline))
    except EntryNotFoundError as e:
        if required and isinstance(e, FileNotFoundError):   # offline (or unreachable), uncached
            _failed(repo_id, revision, e)
        return None
    except Exception as e:       # network, auth, missing repo/revision: all one line for the user
        _failed(repo_id, revision, e)


def _failed(repo_id: str, revision: str | None, e: Exception):
    raise ConversionError(f"{repo_id}@{revision or 'main'}: download failed "
                          f"({_why(repo_id, revision, e)})") from None


def _why(repo_id: str, revision: str | None, e: Exception) -> str:
    """What a huggingface_hub error means for the user, in a few words."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    if isinstance(e, GatedRepoError):
        return (f"{repo_id} is a gated repository: accept its terms at "
                f"{constants.ENDPOINT}/{repo_id} and log in (`hf auth login` or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"repository not found: {repo_id}; check the repo id's spelling (a private "
                f"repository needs `hf auth login` or HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return f"revision {revision} not found in {repo_id}"
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        how = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() \
            else f"{constants.ENDPOINT} cannot be reached"
        return f"offline: {how} and {repo_id} is not in the local Hugging Face cache"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The repo's snapshot when huggingface_hub's cache already holds it whole (no network)."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=FETCH_PATTERNS,
                                      local_files_only=True))
    except Exception:
        return None


def _snapshot_download(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=FETCH_PATTERNS)
    except Exception as e:       # network, auth, missing repo/revision: all one line for the user
        _failed(repo_id, revision, e)
