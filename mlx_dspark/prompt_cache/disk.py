"""Session snapshots on disk (``--prompt-cache-dir``): they outlive the process.

One snapshot is one safetensors file: its arrays (the tokens, each attention layer's keys and
values, each Mamba layer's conv window and SSM state, the drafter's context, the queued taps)
and, in the header's ``__metadata__``, what it belongs to: the format, the *identity* (the
target's and drafter's conversion-receipt hashes, the compute dtype, the device kind), the
space (API key and ``cache_salt``, hashed), the SHA-256 of the tokens, the layout needed to
rebuild the snapshot, and the SHA-256 of the whole data section.

Files are written to a temporary name and renamed (a crash leaves no half file under a real
name), streamed array by array (no second copy of the snapshot in memory). A file is used only
when it is a regular file (not a symlink) owned by this user, its format and identity match,
its data hashes to the recorded checksum and its layers are the model's kinds; anything else is skipped with one warning line and the prompt is prefilled cold. The store
keeps at most ``budget`` bytes of anonymous snapshots, evicting the least recently used (the
files' modification times, touched on use); named snapshots (``/save NAME``,
``mlx-dspark cache-prompt``) live under ``named/`` and are never evicted."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
from dataclasses import dataclass

import mlx.core as mx

from ..decode.session import Snapshot

FORMAT = "mlx-dspark-snapshot/1"
SUFFIX = ".safetensors"
MAX_HEADER = 64 << 20           # a longer header is not one of ours
log = logging.getLogger("mlx_dspark.prompt_cache")

_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int32: "I32",
           mx.uint32: "U32"}


class SnapshotError(ValueError):
    """A file that is not a usable snapshot of this model (the message says why)."""


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


def identity(model_hash: str, drafter_hash: str | None, dtype, pattern: str) -> dict:
    """What a snapshot belongs to: the same tokens on another model, drafter, dtype or device
    kind give another state. ``pattern``: the target's layer kinds (hybrid_override_pattern)."""
    return {"model": model_hash, "drafter": drafter_hash, "dtype": str(dtype),
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
                     pair.target.config.hybrid_override_pattern)
    return PromptStore(directory, ident, budget, warn)


# --------------------------------------------------------------------------------- encoding


def _tensors(snap: Snapshot) -> tuple[dict, dict]:
    """The snapshot's arrays by name, and the layout that puts them back."""
    arrays = {"tokens": mx.array(snap.tokens, dtype=mx.int32)}
    offset, layers = snap.cache
    kinds = []
    for i, layer in enumerate(layers):
        if layer is None:       # a stateless block, or attention before any token
            kinds.append(None)
            continue
        # Mamba: (conv [b, K-1, C] or None, ssm [b, h, p, n] or None); attention: (k, v)
        mamba = layer[0] is None or layer[0].ndim == 3
        kinds.append("mamba" if mamba else "kv")
        for name, x in zip(("conv", "ssm") if mamba else ("k", "v"), layer):
            if x is not None:
                arrays[f"t.{i}.{name}"] = x
    layout = {"offset": offset, "layers": kinds, "pending_start": snap.pending_start,
              "pending": len(snap.pending), "drafter": None}
    for j, x in enumerate(snap.pending):
        arrays[f"p.{j}"] = x
    if snap.drafter is not None:
        # Each drafter's cache has its own state (DSpark: length and K/V per layer; MTP and
        # EAGLE-3 add the newest context row): stored as its nesting and its arrays in order.
        flat = []
        layout["drafter"] = {"tree": _flatten(snap.drafter, flat)}
        for j, x in enumerate(flat):
            arrays[f"d.{j}"] = x
    return arrays, layout


def _flatten(tree, out: list):
    """The JSON shape of a nest of tuples, ints, None and arrays; the arrays go to ``out``."""
    if isinstance(tree, mx.array):
        out.append(tree)
        return "array"
    if tree is None or isinstance(tree, int):
        return tree
    return [_flatten(t, out) for t in tree]


def _unflatten(spec, arrays: dict, at: list):
    if spec == "array":
        at[0] += 1
        return arrays[f"d.{at[0] - 1}"]
    if spec is None or isinstance(spec, int):
        return spec
    return tuple(_unflatten(t, arrays, at) for t in spec)


def _snapshot(arrays: dict, layout: dict) -> Snapshot:
    """The inverse of :func:`_tensors` (arrays checked by the caller's layout checks)."""
    layers = []
    for i, kind in enumerate(layout["layers"]):
        if kind is None:
            layers.append(None)
        elif kind == "mamba":
            layers.append((arrays.get(f"t.{i}.conv"), arrays.get(f"t.{i}.ssm")))
        else:
            k, v = arrays.get(f"t.{i}.k"), arrays.get(f"t.{i}.v")
            layers.append(None if k is None else (k, v))
    drafter = None
    if layout["drafter"] is not None:
        drafter = _unflatten(layout["drafter"]["tree"], arrays, [0])
    pending = tuple(arrays[f"p.{j}"] for j in range(layout["pending"]))
    tokens = tuple(arrays["tokens"].tolist())
    snap = Snapshot(tokens, (layout["offset"], tuple(layers)), drafter, pending,
                    layout["pending_start"], 0)
    return snap.with_nbytes()


def _raw(x: mx.array) -> memoryview:
    """The bytes of an evaluated array, row-major, without copying when it is contiguous."""
    if x.size == 0:
        return memoryview(b"")
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    m = memoryview(x)
    if not m.c_contiguous:
        m = memoryview(mx.contiguous(x))
    return m.cast("B")


# ------------------------------------------------------------------------------------ store


@dataclass
class Entry:
    path: str
    tokens: tuple
    space: str
    size: int
    used: float                 # last use (the file's modification time)


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
        _own_directory(self.dir)
        _own_directory(os.path.join(self.dir, "named"))
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
        """The snapshot of ``entry``, verified; None (one warning, the file dropped from the
        index) when it cannot be used."""
        import time
        t0 = time.perf_counter()
        try:
            snap, meta = read_snapshot(entry.path, self.ident)
            if snap.tokens != entry.tokens or meta.get("space") != entry.space:
                raise SnapshotError("its tokens changed since it was indexed")
        except (SnapshotError, OSError, ValueError) as e:
            self.warn(f"prompt cache: {entry.path}: {e}; not used (the prompt is prefilled)")
            self.entries.pop(entry.path, None)
            return None
        _touch(entry.path)
        entry.used = os.stat(entry.path).st_mtime
        self.reads += 1
        self.t_read += time.perf_counter() - t0
        return snap

    # --- saving

    def add(self, snap: Snapshot, space: str = "") -> bool:
        """Write ``snap`` unless it is there already or larger than the budget; evict the
        least recently used files to make room. False when nothing was written."""
        import time
        path = os.path.join(self.dir, self._name(snap.tokens, space))
        if path in self.entries:
            _touch(path)
            return False
        if snap.nbytes > self.budget:
            return False
        self._evict(self.budget - snap.nbytes)
        t0 = time.perf_counter()
        try:
            size = write_snapshot(path, snap, self.ident, space)
        except OSError as e:
            if not self.failing:        # one line when writes start failing, not one each
                self.warn(f"prompt cache: cannot write {path} ({e.strerror or e}); snapshots "
                          f"stay in memory only until a write succeeds")
            self.failing = True
            return False
        self.failing = False
        self.writes += 1
        self.t_write += time.perf_counter() - t0
        self.entries[path] = Entry(path, tuple(snap.tokens), space, size,
                                   os.stat(path).st_mtime)
        self._evict(self.budget)
        return True

    def save_named(self, name: str, snap: Snapshot, extra: dict) -> str:
        """Write ``snap`` as ``named/NAME`` with ``extra`` (JSON) beside it; returns the path."""
        path = self.named_path(name)
        write_snapshot(path, snap, self.ident, "", extra)
        return path

    def load_named(self, name: str) -> tuple[Snapshot, dict]:
        """The snapshot saved as ``name`` and its extra; SnapshotError (or OSError) when it
        is missing or unusable."""
        path = self.named_path(name)
        if not os.path.lexists(path):
            raise SnapshotError(f"no saved conversation named {name!r} in {self.dir}")
        snap, meta = read_snapshot(path, self.ident)
        try:
            return snap, json.loads(meta.get("extra") or "{}")
        except ValueError:
            raise SnapshotError(f"{path}: its saved conversation is not JSON") from None

    def named_path(self, name: str) -> str:
        if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
            raise SnapshotError(f"{name!r} is not a usable name (no slashes, not starting "
                                f"with a dot)")
        return os.path.join(self.dir, "named", name + SUFFIX)

    # --- internals

    def _name(self, tokens, space: str) -> str:
        h = hashlib.sha256(json.dumps(self.ident, sort_keys=True).encode())
        h.update(space.encode() + b"\0")
        h.update(struct.pack(f"<{len(tokens)}i", *tokens))
        return h.hexdigest()[:40] + SUFFIX

    def _evict(self, room: int):
        while self.entries and self.nbytes > room:
            old = min(self.entries.values(), key=lambda e: e.used)
            del self.entries[old.path]
            try:
                os.unlink(old.path)
            except OSError:
                pass

    def _scan(self):
        """Index the snapshots already in the directory; what cannot be used is skipped, with
        one warning line in all (its count by reason, and the first such file)."""
        skipped: dict[str, list[str]] = {}
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if name.startswith(".tmp-"):
                _remove_stale(path)
                continue
            if name == "named":
                continue
            try:
                meta, st = _header(path)
                if meta.get("identity") != _canon(self.ident):
                    raise SnapshotError("another model's, drafter's, dtype's or device's")
                tokens = _read_tokens(path, meta)
            except (SnapshotError, OSError, ValueError) as e:
                skipped.setdefault(str(e), []).append(name)
                continue
            self.entries[path] = Entry(path, tokens, meta.get("space", ""), st.st_size,
                                       st.st_mtime)
        if skipped:
            reasons = "; ".join(f"{why}: {len(names)}" for why, names in skipped.items())
            first = next(iter(skipped.values()))[0]
            self.warn(f"prompt cache: {self.dir}: {sum(map(len, skipped.values()))} file(s) "
                      f"not used ({reasons}; e.g. {first})")
        self._evict(self.budget)


def _canon(ident: dict) -> str:
    return json.dumps(ident, sort_keys=True)


def _touch(path: str):
    try:
        os.utime(path)
    except OSError:
        pass


def _remove_stale(path: str):
    """A temporary file a crashed writer left (ours only)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.unlink(path)
    except OSError:
        pass


def _own_directory(path: str):
    """Create ``path`` (mode 0700) or check that it is a real directory of this user."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a symlink or a file)")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user")


# ------------------------------------------------------------------------------ file format


def write_snapshot(path: str, snap: Snapshot, ident: dict, space: str,
                   extra: dict | None = None) -> int:
    """Write ``snap`` to ``path`` atomically (temporary file, fsync, rename); its size."""
    arrays, layout = _tensors(snap)
    mx.eval(list(arrays.values()))
    digest, offsets, at = hashlib.sha256(), {}, 0
    for name, x in arrays.items():
        raw = _raw(x)
        digest.update(raw)
        offsets[name] = {"dtype": _DTYPES[x.dtype], "shape": list(x.shape),
                         "data_offsets": [at, at + raw.nbytes]}
        at += raw.nbytes
    meta = {"format": FORMAT, "identity": _canon(ident), "space": space,
            "tokens_sha256": hashlib.sha256(_raw(arrays["tokens"])).hexdigest(),
            "n_tokens": str(len(snap.tokens)), "layout": json.dumps(layout),
            "payload_sha256": digest.hexdigest()}
    if extra is not None:
        meta["extra"] = json.dumps(extra)
    header = json.dumps({"__metadata__": meta, **offsets}).encode()
    header += b" " * (-len(header) % 8)
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(fd, "wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header)
            for x in arrays.values():
                fh.write(_raw(x))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return 8 + len(header) + at


def _header(path: str) -> tuple[dict, os.stat_result]:
    """The metadata of a snapshot file, after the checks that need no data."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise SnapshotError("a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError("not a regular file")
    if st.st_uid != os.getuid():
        raise SnapshotError("written by another user")
    if not path.endswith(SUFFIX):
        raise SnapshotError("not a snapshot file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise SnapshotError("truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > st.st_size:
            raise SnapshotError("truncated or not a snapshot (bad header length)")
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise SnapshotError("not a snapshot (header is not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotError(f"not an {FORMAT} file")
    meta = dict(meta, _tensors=header, _data=8 + n)
    return meta, st


def _read_tokens(path: str, meta: dict) -> tuple:
    spec = meta["_tensors"].get("tokens")
    if not isinstance(spec, dict) or spec.get("dtype") != "I32":
        raise SnapshotError("no token list")
    a, b = spec["data_offsets"]
    with open(path, "rb") as fh:
        fh.seek(meta["_data"] + a)
        raw = fh.read(b - a)
    if len(raw) != b - a:
        raise SnapshotError("truncated")
    if hashlib.sha256(raw).hexdigest() != meta.get("tokens_sha256"):
        raise SnapshotError("its tokens do not match their checksum")
    return tuple(struct.unpack(f"<{len(raw) // 4}i", raw))


def read_snapshot(path: str, ident: dict) -> tuple[Snapshot, dict]:
    """The snapshot in ``path`` and its metadata, after every check (SnapshotError)."""
    meta, st = _header(path)
    if meta.get("identity") != _canon(ident):
        raise SnapshotError("a snapshot of another model, drafter, dtype or device")
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb") as fh:
        fh.seek(meta["_data"])
        size = 0
        while block := fh.read(1 << 22):
            digest.update(block)
            size += len(block)
    spans = [s["data_offsets"][1] for k, s in meta["_tensors"].items() if k != "__metadata__"]
    if size != max(spans, default=0):
        raise SnapshotError("truncated" if size < max(spans, default=0) else "has extra bytes")
    if digest.hexdigest() != meta.get("payload_sha256"):
        raise SnapshotError("corrupt (its data does not match its checksum)")
    try:
        arrays = mx.load(path)
        layout = json.loads(meta["layout"])
        snap = _snapshot(arrays, layout)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"not a snapshot this version can read ({type(e).__name__})") \
            from None
    want = [{"*": ("kv", None), "M": ("mamba",)}.get(c, (None,)) for c in ident["layers"]]
    if len(layout["layers"]) != len(want) or \
            any(k not in w for k, w in zip(layout["layers"], want)):
        raise SnapshotError("its layers are not this model's")
    if (snap.drafter is None) != (ident["drafter"] is None):
        raise SnapshotError("taken with a different drafter setting")
    if len(snap.tokens) != int(meta.get("n_tokens", -1)):
        raise SnapshotError("its token count does not match its header")
    return snap, meta
