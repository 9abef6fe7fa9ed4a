"""Streaming safetensors I/O with strict validation and deterministic output.

The format: an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the tensor data, offsets counted from the end of the header. Reading parses only the
header; tensor bytes are later copied range by range through one bounded buffer, so memory
never holds a whole tensor. Sources are read with ``pread`` and every read's length is
checked: a file truncated while it is converted is a one-line error, where a memory mapping
would die of SIGBUS. Writing emits tensors in the given order with fixed metadata and an
8-byte-aligned header, hashing as it goes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError
from .layout import BlockHash

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20      # the safetensors library's own limit
CHUNK_BYTES = 64 << 20            # copy window: bounds the converter's resident memory
SMALL_HASH_BYTES = 1 << 20        # below this, hashing in a helper thread costs more than it saves


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: ``start`` is the absolute file offset."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):                       # linear: headers can hold 10^5 names
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def open_regular(path: Path):
    """Open ``path`` for reading only if it is a regular file: a FIFO or device in SRC would
    block or never end, so it is refused by name instead (O_NONBLOCK keeps the open itself
    from waiting on a FIFO)."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | nonblock))
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing file") from None
    except IsADirectoryError:
        raise ConversionError(f"{path}: not a regular file (a directory)") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise ConversionError(f"{path}: not a regular file (special files are never read)")
    return f


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header (:func:`header_of`)."""
    path = Path(path)
    with open_regular(path) as f:
        return header_of(f, path)[0]


def header_of(f, path: Path) -> tuple[dict[str, TensorInfo], bytes]:
    """The header of the open file ``f``, checked whole: no name twice (a repeated JSON key),
    every dtype known, every shape consistent with its byte range, the ranges inside the
    file, contiguous, never overlapping, and every data byte in a tensor. Also the bytes it
    was read from (length and JSON), for a caller that hashes what it reads."""
    size = os.fstat(f.fileno()).st_size
    head = os.pread(f.fileno(), 8, 0)
    if len(head) < 8:
        raise ConversionError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise ConversionError(f"{path}: corrupt safetensors header (declared length {n})")
    if 8 + n > size:
        raise ConversionError(
            f"{path}: truncated safetensors file (header declares {n} bytes, "
            f"file has {size - 8} after the length)")
    raw = os.pread(f.fileno(), n, 8)
    if len(raw) != n:
        raise ConversionError(f"{path}: file shrank while its header was read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConversionError(f"{path}: corrupt safetensors header ({e})") from None
    except RecursionError:
        raise ConversionError(f"{path}: corrupt safetensors header (nested too deeply)") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}      # MLX writes null
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConversionError(f"{path}: corrupt safetensors header (__metadata__ must map str to str)")

    data_start, data_size = 8 + n, size - 8 - n
    tensors, ranges, ranges_of = {}, [], {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ConversionError(f"{where}: corrupt header entry {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ITEMSIZE:
            raise ConversionError(f"{where}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ConversionError(f"{where}: corrupt shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise ConversionError(f"{where}: corrupt data_offsets {offsets!r}")
        begin, end = offsets
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if end - begin != expected:
            raise ConversionError(
                f"{where}: dtype {dtype} shape {shape} needs {expected} bytes "
                f"but data_offsets span {end - begin}")
        if end > data_size:
            raise ConversionError(
                f"{where}: data ends at byte {end} but the file holds {data_size} data bytes "
                f"(truncated)")
        ranges.append((begin, end, name))
        ranges_of[name] = [begin, end]
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, end - begin)

    covered, last = 0, None
    for begin, end, name in sorted(ranges):
        if begin < covered:
            raise ConversionError(f"{path}: tensor {name!r} overlaps tensor {last!r} "
                                  f"(data_offsets {[begin, end]} and {ranges_of[last]}: one "
                                  f"would alias the other's bytes)")
        if begin > covered:
            raise ConversionError(f"{path}: data bytes {covered}-{begin - 1} belong to no tensor "
                                  f"(a gap before tensor {name!r}; corrupt data_offsets)")
        covered, last = end, name
    if covered != data_size:
        raise ConversionError(
            f"{path}: {data_size - covered} trailing bytes after the last tensor"
            + (f" ({last!r})" if last is not None else "") + ", in no tensor (corrupt file)")
    return tensors, head + raw


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its bytes are the concatenation of ``sources`` (experts stack
    along a new leading axis, so stacking is concatenation of row-major bytes)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    sources: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


def header_bytes(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    """The JSON header, keys in the given order, padded with spaces to 8-byte alignment."""
    header, offset = {"__metadata__": metadata}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_chunks(f, start: int, nbytes: int, buf: memoryview | None = None):
    """Yield ``(offset, memoryview)`` chunks covering bytes ``[start, start + nbytes)`` of the
    open file ``f``, read into one reused buffer of at most CHUNK_BYTES (``buf``, else a new
    one).

    Each view is valid only until the next one is requested. A short read means the file
    shrank under us: that is a ConversionError, never a partial result."""
    if buf is None:
        buf = memoryview(bytearray(min(nbytes, CHUNK_BYTES)))
    pos, end = start, start + nbytes
    while pos < end:
        view = buf[:min(end - pos, len(buf))]
        got = os.preadv(f.fileno(), [view], pos)
        if got != len(view):
            raise ConversionError(f"{f.name}: file shrank while converting (no data at byte "
                                  f"{pos + got}; was it modified or truncated?)")
        yield pos, view
        pos += got


class SourceFiles:
    """The open source files, by path."""

    def __init__(self):
        self._files = {}

    def open(self, path: Path):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open_regular(path)
        return f

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


class OutFile:
    """An output file that hashes exactly the bytes it holds.

    Large source ranges are copied by the kernel (``os.sendfile``: cheaper than ``write`` from
    user memory, docs/history/measurements.md and docs/history/safety-convert.md) and each chunk is then read
    back from the output with ``pread`` and hashed by a helper thread while the next chunk is
    copied. No source byte is ever memory-mapped: a source that shrinks makes ``sendfile``
    come up short, which is a one-line error. Where the kernel cannot copy file to file
    (macOS), the chunk goes through the buffer instead."""

    def __init__(self, path: Path, hasher: ThreadPoolExecutor):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._sha, self._blocks = hashlib.sha256(), BlockHash()
        self._hasher = hasher
        self._pending = []               # the hashes of the last chunk, still running
        self._buf = None                 # allocated once per file, not per tensor
        self._kernel_copy = hasattr(os, "sendfile")
        self.size = 0

    def _settle(self) -> None:
        for p in self._pending:
            p.result()
        self._pending = []

    def _write(self, view) -> None:
        while view:
            view = view[os.write(self._fd, view):]

    def write(self, data) -> None:
        self._settle()                   # hash updates stay in file order
        self._write(memoryview(data))
        self._sha.update(data)
        self._blocks.update(data)
        self.size += len(data)

    def copy_range(self, f, start: int, nbytes: int) -> None:
        if nbytes < SMALL_HASH_BYTES:
            for _, view in read_chunks(f, start, nbytes):
                self.write(view)
            return
        if self._buf is None:
            self._buf = memoryview(bytearray(CHUNK_BYTES))
        pos, end = start, start + nbytes
        while pos < end:
            n = min(end - pos, CHUNK_BYTES)
            self._copy(f, pos, n)        # overlaps the previous chunk's hash
            self._settle()               # ... which frees the buffer
            view = self._buf[:n]
            if os.preadv(self._fd, [view], self.size) != n:
                raise ConversionError(f"{self.path}: output shorter than what was written")
            # the whole-file hash and the block hashes, side by side
            self._pending = [self._hasher.submit(h.update, view) for h in (self._sha, self._blocks)]
            self.size += n
            pos += n

    def _copy(self, f, pos: int, n: int) -> None:
        """Append source bytes ``[pos, pos + n)``."""
        if self._kernel_copy:
            try:
                done = 0
                while done < n:
                    sent = os.sendfile(self._fd, f.fileno(), pos + done, n - done)
                    if sent == 0:
                        raise ConversionError(f"{f.name}: file shrank while converting (no data "
                                              f"at byte {pos + done}; was it modified or "
                                              f"truncated?)")
                    done += sent
                return
            except OSError as e:
                if done or e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK,
                                           errno.EOPNOTSUPP):
                    raise
                self._kernel_copy = False
        self._settle()
        for _, view in read_chunks(f, pos, n, self._buf):
            self._write(view)

    def close(self) -> dict:
        """The file's receipt entry: size, sha256 and the per-block sha256s."""
        try:
            self._settle()
        finally:
            os.close(self._fd)
        return {"size": self.size, "sha256": self._sha.hexdigest(), "blocks": self._blocks.blocks()}


def write_safetensors(path: Path, tensors: list[OutTensor], metadata: dict[str, str],
                      files: SourceFiles, on_bytes=None) -> dict:
    """Stream ``tensors`` (in the given order) into ``path``; returns its receipt entry
    (size, sha256, blocks)."""
    with ThreadPoolExecutor(2) as hasher:
        out = OutFile(path, hasher)
        try:
            out.write(header_bytes(tensors, metadata))
            for t in tensors:
                for src in t.sources:
                    out.copy_range(files.open(src.file), src.start, src.nbytes)
                    if on_bytes is not None:
                        on_bytes(src.nbytes)
        finally:
            entry = out.close()
    return entry


def sha256_file(path: Path, stop=None) -> tuple[int, str]:
    """(size, sha256) of a file; ``stop()`` returning True abandons the work early."""
    sha = hashlib.sha256()
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        for _, chunk in read_chunks(f, 0, size):
            if stop is not None and stop():
                raise ConversionError(f"{path}: hashing stopped")
            sha.update(chunk)
    return size, sha.hexdigest()
