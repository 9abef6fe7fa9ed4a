"""One session snapshot as one safetensors file (disk.py keeps the directory of them).

The arrays: ``tokens`` (int32), per target layer ``t.{i}.conv`` and ``t.{i}.ssm`` (Mamba) or
``t.{i}.k`` and ``t.{i}.v`` (attention), the queued taps ``p.{j}`` and the drafter's cache
state ``d.{j}``. The header's ``__metadata__`` holds what the file belongs to (``identity``:
receipts, drafter kind, dtype, device, layers), its ``space``, its token count and their
SHA-256 (checked when a directory is indexed, without reading the rest), the ``layout`` that
puts the arrays back together, and two checksums (:func:`seal`): ``sha256``, the SHA-256 of
the canonical header (without its checksums, as :func:`canonical` writes it) followed by the
data, checked before a snapshot is used, and ``header_sha256``, of the canonical header with
``sha256``, checked when a directory is indexed. No bit of the file changes unnoticed, a
tensor's name in the header included.

Reading trusts nothing it has not checked, in pure Python (no other parser sees the file): the
header's length must fit the file, its JSON be an object of the safetensors shape; every span
must lie in the data, tile it in order and hold exactly its shape's bytes; the tensors must be
exactly those the layout implies for the model's layer pattern, with its dtypes (a missing
state is an error, never an empty one). Only then are the bytes read, tensor by tensor, hashed
as they go, and the state rebuilt and checked against the layer pattern
(:func:`~mlx_dspark.session.layout_problem`). Every refusal is a :class:`SnapshotError`."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from math import prod

import mlx.core as mx
import numpy as np

from ..decode.session import Origin, Snapshot, layout_problem

FORMAT = "mlx-dspark-snapshot/2"
MAX_HEADER = 64 << 20           # a longer header is not one of ours
MAX_RANK = 8
MAX_DEPTH = 16                  # of the drafter's state (a few levels in every drafter)

# safetensors dtype code: (MLX dtype, NumPy dtype of the raw bytes)
_DTYPES = {"F32": (mx.float32, np.float32), "F16": (mx.float16, np.float16),
           "BF16": (mx.bfloat16, np.uint16), "I32": (mx.int32, np.int32),
           "U32": (mx.uint32, np.uint32)}
_CODES = {str(d): code for code, (d, _) in _DTYPES.items()}
_SPEC_KEYS = {"dtype", "shape", "data_offsets"}
_LAYOUT_KEYS = {"offset", "layers", "pending_start", "pending", "drafter"}
_CHECKSUMS = {"sha256", "header_sha256"}
_META_KEYS = {"format", "identity", "space", "tokens_sha256", "n_tokens", "layout"} | _CHECKSUMS


class SnapshotError(ValueError):
    """A file that is not a usable snapshot of this model (the message says why)."""


def canonical(obj) -> bytes:
    """The one byte string a JSON value is hashed as (sorted keys, no spaces, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def origin_of(ident: dict) -> Origin:
    """The origin of the snapshots of a store's ``ident`` (disk.identity)."""
    return Origin(ident["model"], ident["drafter"], ident["kind"], ident["dtype"])


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


def _snapshot(arrays: dict, layout: dict, origin: Origin) -> Snapshot:
    """The inverse of :func:`_tensors`, for a layout whose tensors are all in ``arrays``."""
    layers = []
    for i, kind in enumerate(layout["layers"]):
        if kind is None:
            layers.append(None)
        else:
            names = ("conv", "ssm") if kind == "mamba" else ("k", "v")
            layers.append(tuple(arrays.get(f"t.{i}.{n}") for n in names))
    drafter = None
    if layout["drafter"] is not None:
        drafter = _unflatten(layout["drafter"]["tree"], arrays, [0])
    pending = tuple(arrays[f"p.{j}"] for j in range(layout["pending"]))
    tokens = tuple(arrays["tokens"].tolist())
    snap = Snapshot(tokens, (layout["offset"], tuple(layers)), drafter, pending,
                    layout["pending_start"], 0, origin)
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


# ---------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Encoded:
    """A snapshot file's bytes before they are written: the header (its length first) and
    the evaluated arrays, written from their own buffers (no second copy of the snapshot)."""

    head: bytes
    arrays: tuple

    @property
    def size(self) -> int:
        return len(self.head) + sum(_raw(x).nbytes for x in self.arrays)


def encode(snap: Snapshot, ident: dict, space: str, extra: dict | None = None) -> Encoded:
    """The file of ``snap``, a snapshot of ``ident``'s model in ``space`` (``extra``: JSON
    kept in the header, a named snapshot's conversation)."""
    arrays, layout = _tensors(snap)
    mx.eval(list(arrays.values()))
    header, at = {}, 0
    for name, x in arrays.items():
        n = _raw(x).nbytes
        header[name] = {"dtype": _CODES[str(x.dtype)], "shape": list(x.shape),
                        "data_offsets": [at, at + n]}
        at += n
    meta = {"format": FORMAT, "identity": json.dumps(ident, sort_keys=True), "space": space,
            "tokens_sha256": hashlib.sha256(_raw(arrays["tokens"])).hexdigest(),
            "n_tokens": str(len(snap.tokens)), "layout": json.dumps(layout)}
    if extra is not None:
        meta["extra"] = json.dumps(extra)
    header["__metadata__"] = meta
    seal(header, (_raw(x) for x in arrays.values()))
    head = canonical(header)
    head += b" " * (-len(head) % 8)
    return Encoded(struct.pack("<Q", len(head)) + head, tuple(arrays.values()))


def seal(header: dict, data):
    """Put the checksums of ``header`` and its ``data`` (byte strings, in file order) into
    the header's metadata: ``sha256`` over the canonical header and the data, then
    ``header_sha256`` over the canonical header with ``sha256`` (what a scan checks)."""
    digest = _digest(header)
    for raw in data:
        digest.update(raw)
    header["__metadata__"]["sha256"] = digest.hexdigest()
    header["__metadata__"]["header_sha256"] = _header_digest(header)


def write(path: str, encoded: Encoded, dir_fd: int | None = None) -> int:
    """Write ``encoded`` to ``path`` (relative to the directory ``dir_fd`` when given)
    atomically: a temporary file, fsync, rename. Returns its size."""
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                 dir_fd=dir_fd)
    try:
        with open(fd, "wb") as fh:
            fh.write(encoded.head)
            for x in encoded.arrays:
                fh.write(_raw(x))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    return encoded.size


def write_snapshot(path: str, snap: Snapshot, ident: dict, space: str,
                   extra: dict | None = None, dir_fd: int | None = None) -> int:
    """:func:`encode` and :func:`write` in one call; the file's size."""
    return write(path, encode(snap, ident, space, extra), dir_fd)


def _digest(header: dict):
    """A SHA-256 fed with the canonical header (checksums left out), length first: the data
    goes in next."""
    meta = {k: v for k, v in header["__metadata__"].items() if k not in _CHECKSUMS}
    head = canonical(dict(header, __metadata__=meta))
    digest = hashlib.sha256(struct.pack("<Q", len(head)))
    digest.update(head)
    return digest


def _header_digest(header: dict) -> str:
    meta = {k: v for k, v in header["__metadata__"].items() if k != "header_sha256"}
    return hashlib.sha256(canonical(dict(header, __metadata__=meta))).hexdigest()


# ---------------------------------------------------------------------------------- reading


class SnapshotFile:
    """An open snapshot file of ``ident``'s model whose header passed every check (the data
    is checked as it is read)."""

    def __init__(self, path: str, ident: dict):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:      # what O_NOFOLLOW answers for a symlink
                raise SnapshotError("a symlink") from None
            raise
        self.fh = open(fd, "rb")
        try:
            self.st = _own_file(os.fstat(fd))
            self.header, self.data = _read_header(self.fh, self.st.st_size)
            self.meta = self.header["__metadata__"]
            if _header_digest(self.header) != self.meta["header_sha256"]:
                raise SnapshotError("corrupt (its header does not match its checksum)")
            self.tensors = _spans(self.header, self.st.st_size - self.data)
            self.layout = _layout(self.meta, ident)
            _check_tensors(self.tensors, self.layout, ident)
        except BaseException:
            self.fh.close()
            raise
        self.ident = ident

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def tokens(self) -> tuple:
        """The token list, checked against its own checksum (the scan's cheap check)."""
        raw = self._read("tokens")
        if hashlib.sha256(raw).hexdigest() != self.meta["tokens_sha256"]:
            raise SnapshotError("its tokens do not match their checksum")
        return tuple(np.frombuffer(raw, np.int32).tolist())

    def snapshot(self) -> Snapshot:
        """Every array, read once and hashed on the way; the snapshot once the file's checksum
        and the state's layout hold."""
        digest, arrays = _digest(self.header), {}
        for name, (code, shape, _, _) in sorted(self.tensors.items(), key=lambda t: t[1][2]):
            raw = self._read(name)
            digest.update(raw)
            mlx_dtype, np_dtype = _DTYPES[code]
            arrays[name] = mx.array(np.frombuffer(raw, np_dtype).reshape(shape)).view(mlx_dtype)
        if digest.hexdigest() != self.meta["sha256"]:
            raise SnapshotError("corrupt (it does not match its checksum)")
        snap = _snapshot(arrays, self.layout, origin_of(self.ident))
        problem = layout_problem(snap, self.ident["layers"], self.ident["dtype"])
        if problem is not None:
            raise SnapshotError(f"not a state of this model ({problem})")
        return snap

    def _read(self, name: str) -> bytes:
        _, _, start, end = self.tensors[name]
        self.fh.seek(self.data + start)
        raw = self.fh.read(end - start)     # bounded: the span lies inside the file
        if len(raw) != end - start:
            raise SnapshotError("truncated (it changed while it was read)")
        return raw


def read_snapshot(path: str, ident: dict) -> tuple[Snapshot, dict]:
    """The snapshot in ``path`` and its header's metadata, after every check."""
    with SnapshotFile(path, ident) as f:
        return f.snapshot(), f.meta


def _own_file(st: os.stat_result) -> os.stat_result:
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError("not a regular file")
    if st.st_uid != os.getuid():
        raise SnapshotError("written by another user")
    return st


def _read_header(fh, size: int) -> tuple[dict, int]:
    """The header, parsed, and where the data starts."""
    head = fh.read(8)
    if len(head) < 8:
        raise SnapshotError("truncated (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise SnapshotError("truncated or not a snapshot (bad header length)")
    try:
        header = json.loads(fh.read(n))
    except (ValueError, RecursionError):        # RecursionError: a crafted deep nesting
        raise SnapshotError("not a snapshot (its header is not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotError(f"not an {FORMAT} file")
    keys = set(meta) - {"extra"}
    if keys != _META_KEYS or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotError("its header's metadata is not this format's")
    return header, 8 + n


def _spans(header: dict, size: int) -> dict:
    """name -> (dtype code, shape, start, end), once every span is checked: it holds exactly
    its shape's bytes, and the spans tile the ``size`` bytes of data in order."""
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict) or set(spec) != _SPEC_KEYS or spec["dtype"] not in _DTYPES:
            raise SnapshotError(f"tensor {name!r}: not a safetensors entry of this format")
        shape, span = spec["shape"], spec["data_offsets"]
        if not _ints(shape) or len(shape) > MAX_RANK or not _ints(span) or len(span) != 2:
            raise SnapshotError(f"tensor {name!r}: its shape or span is not whole numbers")
        start, end = span
        itemsize = np.dtype(_DTYPES[spec["dtype"]][1]).itemsize
        if end - start != prod(shape) * itemsize:
            raise SnapshotError(f"tensor {name!r}: its span does not hold its shape")
        out[name] = (spec["dtype"], tuple(shape), start, end)
    at = 0
    for name, (_, _, start, end) in sorted(out.items(), key=lambda t: t[1][2]):
        if start != at:
            raise SnapshotError(f"tensor {name!r}: its span overlaps or leaves a gap")
        at = end
    if at != size:
        raise SnapshotError("truncated" if at > size else "it has extra bytes")
    return out


def _ints(xs) -> bool:
    """A list of whole numbers, none negative (JSON's true is not one)."""
    return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)


def _layout(meta: dict, ident: dict) -> dict:
    """The metadata's layout, once it is one of ``ident``'s model (the file is its own)."""
    if meta["identity"] != json.dumps(ident, sort_keys=True):
        raise SnapshotError("a snapshot of another model, drafter, dtype or device")
    try:
        layout = json.loads(meta["layout"])
    except (ValueError, RecursionError):
        raise SnapshotError("its layout is not JSON") from None
    if not isinstance(layout, dict) or set(layout) != _LAYOUT_KEYS \
            or not _ints([layout[k] for k in ("offset", "pending_start", "pending")]):
        raise SnapshotError("its layout is not this format's")
    offset = layout["offset"]
    if meta["n_tokens"] != str(offset) or layout["pending_start"] > offset:
        raise SnapshotError("its token count does not match its layout")
    if layout["layers"] != _kinds(ident["layers"], offset):
        raise SnapshotError("its layers are not this model's")
    drafter = layout["drafter"]
    if (drafter is None) != (ident["drafter"] is None):
        raise SnapshotError("taken with a different drafter setting")
    if drafter is not None and (not isinstance(drafter, dict) or set(drafter) != {"tree"}
                                or not _tree(drafter["tree"], MAX_DEPTH)):
        raise SnapshotError("its drafter state is not this format's")
    return layout


def _kinds(pattern: str, offset: int) -> list:
    """The layer kinds a snapshot of ``offset`` tokens of a ``pattern`` target records."""
    return ["mamba" if c == "M" else "kv" if c == "*" and offset else None for c in pattern]


def _tree(spec, depth: int) -> bool:
    """A drafter state's nesting: lists of "array", None and whole numbers."""
    if spec == "array" or spec is None or (type(spec) is int and spec >= 0):
        return True
    return isinstance(spec, list) and depth > 0 and all(_tree(t, depth - 1) for t in spec)


def _leaves(spec) -> int:
    """How many arrays a drafter state's nesting holds."""
    return 1 if spec == "array" else sum(map(_leaves, spec)) if isinstance(spec, list) else 0


def _check_tensors(tensors: dict, layout: dict, ident: dict):
    """The tensors are exactly those ``layout`` implies, each with its dtype and rank."""
    want = _expected(layout, ident)
    for name in sorted(set(want) | set(tensors)):
        if name not in tensors:
            raise SnapshotError(f"its tensor {name} is missing")
        if name not in want:
            raise SnapshotError(f"it has a tensor {name!r} that its layout has no place for")
        code, shape, _, _ = tensors[name]
        dtype, rank = want[name]
        if (dtype is not None and code != dtype) or (rank is not None and len(shape) != rank):
            raise SnapshotError(f"its tensor {name} is {code} {list(shape)}, not "
                                f"{dtype or 'any dtype'} with {rank} axes")


def _expected(layout: dict, ident: dict) -> dict:
    """name -> (dtype code or None for any, rank or None for any) of the tensors of
    ``layout``: a Mamba layer's two float32 states exist from the first token on."""
    dtype, offset = _CODES.get(ident["dtype"]), layout["offset"]
    want = {"tokens": ("I32", 1)}
    for i, kind in enumerate(layout["layers"]):
        if kind == "mamba" and offset:
            want.update({f"t.{i}.conv": ("F32", 3), f"t.{i}.ssm": ("F32", 4)})
        elif kind == "kv":
            want.update({f"t.{i}.k": (dtype, 4), f"t.{i}.v": (dtype, 4)})
    want.update({f"p.{j}": (dtype, 2) for j in range(layout["pending"])})
    if layout["drafter"] is not None:
        n = _leaves(layout["drafter"]["tree"])
        want.update({f"d.{j}": (None, None) for j in range(n)})
    return want
