"""Hashes of a directory that came without a conversion receipt (an mlx-lm conversion, a plain
Hugging Face download): taken at its first load, kept in mlx-dspark's cache
(``$MLX_DSPARK_CACHE/recorded``, never in the model's directory), and checked at every later
load and by ``mlx-dspark verify``, at the levels a receipt is checked (integrity.py).

A record proves less than a receipt: that the files are those of the first load, not that a
converter made them from a pinned source. It holds, per file the load reads, its size, SHA-256
and the SHA-256 of each ``RECEIPT_BLOCK_BYTES`` block (so ``fast`` can sample), and the
directory it describes. MLX-free."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..converter.layout import BlockHash, weight_files
from .hub import cache_root
from .private_dir import private_directory
from .integrity import (FULL_AUTO_BYTES, READ_BYTES, CheckpointError, Reads, _output,
                        check_checkpoint, check_level, receipt_outputs, verify_outputs)
from .integrity import verify_directory as verify_receipt

FORMAT = "mlx-dspark-recorded/1"
KEPT = ("config.json", "generation_config.json", "model.safetensors.index.json",
        "hf_quant_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
        "chat_template*", "vocab.*", "merges.txt", "preprocessor_config.json",
        "processor_config.json")
"""Besides the weight files, what a record covers: what the load reads (config, tokenizer,
an Omni's media processing)."""
WORDS = ("the hashes recorded at its first load", "since its first load")


def record_file(path) -> Path:
    """Where the record of directory ``path`` (by its real path) lives."""
    real = os.path.realpath(path)
    return cache_root() / "recorded" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"


def _files(path: str) -> list[str]:
    names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
                   and any(fnmatch.fnmatchcase(n, p) for p in KEPT))
    return names + [os.path.basename(f) for f in weight_files(path)]


def _hash(f: str) -> dict:
    whole, blocks, size = hashlib.sha256(), BlockHash(), 0
    with open(f, "rb") as fh:
        while chunk := fh.read(READ_BYTES):
            whole.update(chunk)
            blocks.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": whole.hexdigest(), "blocks": blocks.blocks()}


def _announce(path: str, names: list[str]) -> None:
    total = sum(os.path.getsize(os.path.join(path, n)) for n in names)
    if total > FULL_AUTO_BYTES:
        print(f"mlx-dspark: {path} has no conversion receipt: hashing its {total / 1e9:.1f} GB "
              f"once, to check later loads against", file=sys.stderr, flush=True)


def _hash_all(path: str, names: list[str]) -> dict:
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(_hash, [os.path.join(path, n) for n in names])))


def record(path) -> Path:
    """Hash the files of ``path`` now and keep them as its record (replacing an older one)."""
    path = str(path)
    names = _files(path)
    _announce(path, names)
    return _write(path, _hash_all(path, names))


def _write(path: str, hashed: dict) -> Path:
    doc = {"format": FORMAT, "path": os.path.realpath(path),
           "recorded": time.strftime("%Y-%m-%d %H:%M:%S"), "outputs": hashed}
    out = record_file(path)
    _store(out.parent, create=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, out)
    return out


def _store(where: Path, create: bool = False) -> None:
    """The record store as the disk prompt cache takes its directory: a real directory of this
    user that no one else may write (prompt_cache/disk.py), else OSError saying why."""
    if create:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
    with private_directory(str(where)):
        pass


class _Recording(Reads):
    """A first load: the weight files hashed as the load reads them, the record written from
    those hashes (and the small files', taken now) once every file is read."""

    def __init__(self, path: str):
        super().__init__()
        self.path, names = path, _files(path)
        _announce(path, names)
        weights = {os.path.basename(f) for f in weight_files(path)}
        self.hashed = _hash_all(path, [n for n in names if n not in weights])
        for n in weights:
            self[os.path.join(path, n)] = _Hashing()

    def done(self) -> None:
        for f, h in self.items():
            self.hashed[os.path.basename(f)] = h.entry()
        try:
            _write(self.path, self.hashed)
        except OSError as e:
            print(f"mlx-dspark: warning: cannot record the hashes of {self.path} in "
                  f"{record_file(self.path).parent} ({e.strerror or e}); later loads are "
                  f"unchecked", file=sys.stderr)


class _Hashing:
    """A weight file's record entry from the bytes a load reads (all of them, in order)."""

    def __init__(self):
        self.whole, self.blocks, self.size = hashlib.sha256(), BlockHash(), 0

    def wants(self, start: int, length: int) -> bool:
        return True

    def feed(self, pos: int, data) -> None:
        if pos != self.size:
            raise CheckpointError(f"record: bytes fed out of order ({pos} after {self.size})")
        self.whole.update(data)
        self.blocks.update(data)
        self.size += len(data)

    def finish(self) -> None:
        pass

    def entry(self) -> dict:
        return {"size": self.size, "sha256": self.whole.hexdigest(), "blocks": self.blocks.blocks()}


def recorded(path) -> tuple[list, str] | None:
    """(the files a record lists, when it was taken), or None when ``path`` has none. A store
    that other users can write, or that another user owns, is refused: its records prove
    nothing."""
    where = record_file(path)
    try:
        _store(where.parent)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{where.parent}: the store of recorded hashes is not to be "
                              f"trusted ({e.strerror or e}); cannot check {path}") from None
    try:
        doc = json.loads(where.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: unreadable record of {path}'s hashes ({e}); delete "
                              f"it to record them again") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(
            doc.get("outputs"), dict) or doc.get("path") != os.path.realpath(path):
        raise CheckpointError(f"{where}: not a record of {path}'s hashes; delete it to record "
                              f"them again")
    return ([_output(str(where), n, e) for n, e in sorted(doc["outputs"].items())],
            str(doc.get("recorded")))


def recorded_hash(path) -> str | None:
    """A digest of the record of ``path`` (every file's size and SHA-256), what disk snapshots
    are keyed by where a receipt's digest would be (prompt_cache/disk.py); None without one."""
    try:
        found = recorded(path)
    except CheckpointError:
        return None
    if found is None:
        return None
    files = {o.name: {"size": o.size, "sha256": o.sha256} for o in found[0]}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _check(path: str, outputs: list, verify: str, loading: bool = False) -> Reads:
    hint = f" (if the change is yours, delete {record_file(path)}: the next load records again)"
    listed = {o.name for o in outputs}
    added = [n for n in _files(path) if n not in listed]
    if added:
        raise CheckpointError(f"{os.path.join(path, added[0])}: not there at its first load: a "
                              f"file added {WORDS[1]}{hint}")
    try:        # the hint rides on "since its first load" into the checks made while reading
        return verify_outputs(path, outputs, verify, (WORDS[0], WORDS[1] + hint), loading)
    except CheckpointError as e:
        raise CheckpointError(str(e) if hint in str(e) else f"{e}{hint}") from None


def check_files(path, verify: str = "auto", require_receipt: bool = True) -> Reads:
    """Before a load: the receipt (integrity.check_checkpoint) when the directory has one or
    must have one; otherwise the recorded hashes, taken at this load when it is the first
    (a cache that cannot be written only costs the check: one warning). The small files are
    checked now, the weight files on the bytes the load reads (the :class:`Reads`
    returned, for models/weights.read_weights)."""
    path = str(path)
    if check_level(verify) == "none":
        return Reads()
    if require_receipt or receipt_outputs(path) is not None:
        return check_checkpoint(path, verify, require_receipt)
    found = recorded(path)
    if found is not None:
        return _check(path, found[0], verify, loading=True)
    return _Recording(path)


def verify_directory(path) -> str:
    """``mlx-dspark verify``: every byte against the receipt, or, for a directory without
    one, against the hashes recorded at its first load (taken now when it has none)."""
    path = str(path)
    if not os.path.isdir(path) or receipt_outputs(path) is not None:
        return verify_receipt(path)
    found = recorded(path)
    if found is None:
        if not weight_files(path):
            return verify_receipt(path)          # says: no receipt to check against
        where = record(path)
        return (f"{path}: no conversion receipt; its files' hashes are recorded now ({where}): "
                f"later loads and verify check against them")
    outputs, when = found
    _check(path, outputs, "full")
    return (f"{path}: intact: {len(outputs)} files, {sum(o.size for o in outputs) / 1e6:.1f} MB "
            f"match the hashes recorded at its first load ({when}, SHA-256)")
