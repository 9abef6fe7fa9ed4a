"""Session snapshots on disk (``--prompt-cache-dir``): they outlive the process.

A directory of snapshot files (snapshot_file.py), each named by the SHA-256 of the model's
*identity* (the target's and drafter's conversion-receipt hashes, the drafter's kind, the
compute dtype, the device kind, the layers), the space (API key and ``cache_salt``, hashed)
and the tokens. A file is used only when every check of snapshot_file.py holds; any fault is
one warning line, the entry dropped from the index and the prompt prefilled cold.

The directory is used only while it is a real directory (not a symlink) of this user that no
one else may write: checked at start and again at each write, through a descriptor of the
directory itself, so a symlink swapped in later is refused, never followed. The store keeps
at most ``budget`` bytes of anonymous snapshots *in the directory*, whichever process wrote
them: each write and each eviction runs under an exclusive lock on ``DIR/.lock`` (``flock``)
and counts every snapshot file there, evicting the least recently used (modification times,
touched on use by every process). Named snapshots (``/save NAME``, ``mlx-dspark
cache-prompt``) live under ``named/`` and are never evicted."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from ..checkpoint.private_dir import private_directory
from ..decode.session import Snapshot, drafter_kind
from .snapshot_file import SnapshotError, SnapshotFile, encode, read_snapshot, write, \
    write_snapshot

SUFFIX = ".safetensors"
LOCK = ".lock"
log = logging.getLogger("mlx_dspark.prompt_cache")


class UnknownName(SnapshotError):
    """No snapshot was saved under that name (or none can be: a name with a slash)."""


def receipt_hash(path) -> str | None:
    """The SHA-256 of a converted directory's receipt outputs (every file's size and hash),
    or None without a receipt."""
    from ..converter.layout import load_receipt
    if path is None:
        return None
    receipt = load_receipt(str(path))
    if not isinstance(receipt, dict) or not isinstance(receipt.get("outputs"), dict):
        return None
    return hashlib.sha256(json.dumps(receipt["outputs"], sort_keys=True).encode()).hexdigest()


def identity(model_hash: str, drafter_hash: str | None, dtype, pattern: str,
             kind: str | None = None) -> dict:
    """What a snapshot belongs to: the same tokens on another model, drafter, dtype or device
    kind give another state. ``pattern``: the target's layer kinds (hybrid_override_pattern);
    ``kind``: the drafter's (session.drafter_kind)."""
    return {"model": model_hash, "drafter": drafter_hash, "kind": kind, "dtype": str(dtype),
            "device": "gpu" if mx.default_device() == mx.gpu else "cpu", "layers": pattern}


def open_store(directory, pair, with_drafter: bool, budget: int, warn=None) -> "PromptStore":
    """The store in ``directory`` for sessions of ``pair`` (with its drafter or not).
    SnapshotError when the pair's snapshots cannot be keyed (a checkpoint without a receipt);
    OSError when the directory is not usable."""
    model_hash, drafter_hash = pair.receipts
    if model_hash is None or (with_drafter and drafter_hash is None):
        raise SnapshotError("snapshots on disk are keyed by the conversion receipts' hashes, "
                            "and this model or drafter has no receipt")
    ident = identity(model_hash, drafter_hash if with_drafter else None,
                     getattr(pair.target, "dtype", None),
                     pair.target.config.hybrid_override_pattern,
                     drafter_kind(pair.drafter if with_drafter else None))
    return PromptStore(directory, ident, budget, warn)


# ------------------------------------------------------------------------------------ store


@dataclass
class Entry:
    path: str
    tokens: tuple
    space: str
    size: int


class PromptStore:
    """Snapshots of one model (``ident``) in ``directory``, within ``budget`` bytes."""

    def __init__(self, directory, ident: dict, budget: int, warn=None):
        self.dir = os.path.abspath(os.path.expanduser(str(directory)))
        self.ident, self.budget = ident, budget
        self.warn = warn or (lambda line: log.warning("%s", line))
        self.entries: dict[str, Entry] = {}
        self.writes = self.reads = 0
        self.failing = False            # the last write failed (a full disk)
        self.t_write = self.t_read = 0.0
        for path in (self.dir, os.path.join(self.dir, "named")):
            os.makedirs(path, mode=0o700, exist_ok=True)
            with private_directory(path):      # checked now, and again before each write
                pass
        self._scan()

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    # --- lookup

    def find(self, prompt, space: str = "", longer_than: int = 0) -> Entry | None:
        """The entry of ``space`` with the most tokens (more than ``longer_than``) that are a
        proper prefix of ``prompt``."""
        best = None
        for e in self.entries.values():
            n = len(e.tokens)
            if e.space == space and longer_than < n < len(prompt) \
                    and (best is None or n > len(best.tokens)) \
                    and tuple(prompt[:n]) == e.tokens:
                best = e
        return best

    def __contains__(self, key) -> bool:
        space, tokens = key
        return os.path.join(self.dir, self._name(tokens, space)) in self.entries

    def load(self, entry: Entry) -> Snapshot | None:
        """The snapshot of ``entry``, verified; None (the entry dropped from the index, with
        one warning when the file is unusable) when it cannot be used."""
        t0 = time.perf_counter()
        try:
            snap, meta = read_snapshot(entry.path, self.ident)
            if snap.tokens != entry.tokens or meta["space"] != entry.space:
                raise SnapshotError("its tokens changed since it was indexed")
        except FileNotFoundError:       # evicted by another process sharing the directory
            self.entries.pop(entry.path, None)
            return None
        except (SnapshotError, OSError) as e:
            self.drop(entry, str(e))
            return None
        _touch(entry.path)
        self.reads += 1
        self.t_read += time.perf_counter() - t0
        return snap

    def drop(self, entry: Entry, why: str):
        """Forget ``entry``, whose file cannot be used, with one warning line."""
        self.warn(f"prompt cache: {entry.path}: {why}; not used (the prompt is prefilled)")
        self.entries.pop(entry.path, None)

    # --- saving

    def add(self, snap: Snapshot, space: str = "") -> bool:
        """Write ``snap`` unless it is there already or larger than the budget; evict the
        least recently used files of the directory to make room. False when nothing was
        written."""
        name = self._name(snap.tokens, space)
        path = os.path.join(self.dir, name)
        if path in self.entries:
            _touch(path)
            return False
        t0 = time.perf_counter()
        encoded = encode(snap, self.ident, space)
        if encoded.size > self.budget:
            return False
        try:
            with self._locked() as dfd:
                self._make_room(dfd, self.budget - encoded.size)
                self.entries[path] = Entry(path, tuple(snap.tokens), space,
                                           write(name, encoded, dfd))
        except OSError as e:
            if not self.failing:        # one line when writes start failing, not one each
                self.warn(f"prompt cache: cannot write {path} ({e.strerror or e}); snapshots "
                          f"stay in memory only until a write succeeds")
            self.failing = True
            return False
        self.failing = False
        self.writes += 1
        self.t_write += time.perf_counter() - t0
        return True

    def save_named(self, name: str, snap: Snapshot, extra: dict) -> str:
        """Write ``snap`` as ``named/NAME`` with ``extra`` (JSON) beside it; returns the path."""
        path = self.named_path(name)
        with private_directory(os.path.dirname(path)) as dfd:
            write_snapshot(os.path.basename(path), snap, self.ident, "", extra, dir_fd=dfd)
        return path

    def load_named(self, name: str) -> tuple[Snapshot, dict]:
        """The snapshot saved as ``name`` and its extra; SnapshotError (or OSError) when it
        is missing or unusable."""
        path = self.named_path(name)
        if not os.path.lexists(path):
            raise UnknownName(f"no saved conversation named {name!r} in {self.dir}")
        snap, meta = read_snapshot(path, self.ident)
        try:
            extra = json.loads(meta.get("extra") or "{}")
        except (ValueError, RecursionError):
            extra = None
        if not isinstance(extra, dict):
            raise SnapshotError("its saved conversation is not a JSON object")
        return snap, extra

    def named_path(self, name: str) -> str:
        if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
            raise UnknownName(f"{name!r} is not a usable name (no slashes, not starting "
                              f"with a dot)")
        return os.path.join(self.dir, "named", name + SUFFIX)

    # --- internals

    def _name(self, tokens, space: str) -> str:
        h = hashlib.sha256(json.dumps(self.ident, sort_keys=True).encode())
        h.update(space.encode() + b"\0")
        h.update(struct.pack(f"<{len(tokens)}i", *tokens))
        return h.hexdigest()[:40] + SUFFIX

    @contextmanager
    def _locked(self):
        """The directory, checked, as a descriptor, with its lock held: no other process
        writes or evicts in it meanwhile (closing the lock's descriptor releases it)."""
        with private_directory(self.dir) as dfd:
            lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield dfd
            finally:
                os.close(lock)

    def _make_room(self, dfd: int, room: int):
        """Evict the least recently used snapshot files of the directory (ours: any process's,
        any model's) until they hold at most ``room`` bytes. Under the lock."""
        files = _snapshot_files(dfd)
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= room:
                break
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            total -= size
            self.entries.pop(os.path.join(self.dir, name), None)

    def _scan(self):
        """Index the snapshots already in the directory; what cannot be used is skipped, with
        one warning line in all (its count by reason, and the first such file)."""
        skipped: dict[str, list[str]] = {}
        with self._locked() as dfd:
            for name in sorted(os.listdir(dfd)):
                if name.startswith(".tmp-"):     # under the lock: no writer is running
                    _remove_stale(name, dfd)
                if name.startswith(".") or name == "named":
                    continue
                try:
                    self._index(name)
                except (SnapshotError, OSError) as e:
                    skipped.setdefault(str(e), []).append(name)
            self._make_room(dfd, self.budget)
        if skipped:
            reasons = "; ".join(f"{why}: {len(names)}" for why, names in skipped.items())
            first = next(iter(skipped.values()))[0]
            self.warn(f"prompt cache: {self.dir}: {sum(map(len, skipped.values()))} file(s) "
                      f"not used ({reasons}; e.g. {first})")

    def _index(self, name: str):
        if not name.endswith(SUFFIX):
            raise SnapshotError("not a snapshot file")
        path = os.path.join(self.dir, name)
        with SnapshotFile(path, self.ident) as f:
            self.entries[path] = Entry(path, f.tokens(), f.meta["space"], f.st.st_size)


def _snapshot_files(dfd: int) -> list[tuple[int, str, int]]:
    """(modification time, name, size) of each snapshot file of ours in the directory."""
    out = []
    for name in os.listdir(dfd):
        if name.startswith(".") or not name.endswith(SUFFIX):
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            out.append((st.st_mtime_ns, name, st.st_size))
    return out


def _touch(path: str):
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass


def _remove_stale(name: str, dfd: int):
    """A temporary file a crashed writer left (ours only)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
