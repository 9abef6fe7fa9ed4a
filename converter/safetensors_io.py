"""Streaming safetensors I/O with strict validation and deterministic output.

The format: an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the tensor data, offsets counted from the end of the header. Reading parses only the
header; tensor bytes are later copied range by range (kernel copy, hashed from bounded mmap
windows), so memory never holds a whole tensor. Writing emits tensors in the given order
with fixed metadata and an 8-byte-aligned header, hashing as it goes.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20      # the safetensors library's own limit
CHUNK_BYTES = 64 << 20            # copy window: bounds the converter's resident memory
SMALL_READ_BYTES = 1 << 20        # below this a plain read beats setting up a mapping


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
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header: every dtype known, every shape consistent
    with its byte range, ranges inside the file, contiguous and non-overlapping."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: missing file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > MAX_HEADER_BYTES:
            raise ConversionError(f"{path}: corrupt safetensors header (declared length {n})")
        if 8 + n > size:
            raise ConversionError(
                f"{path}: truncated safetensors file (header declares {n} bytes, "
                f"file has {size - 8} after the length)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConversionError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConversionError(f"{path}: corrupt safetensors header (__metadata__ must map str to str)")

    data_start, data_size = 8 + n, size - 8 - n
    tensors, ranges = {}, []
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
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, end - begin)

    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            kind = "overlaps the previous tensor" if begin < covered else "leaves a gap before it"
            raise ConversionError(f"{path}: tensor {name!r} {kind} (corrupt data_offsets)")
        covered = end
    if covered != data_size:
        raise ConversionError(
            f"{path}: {data_size - covered} trailing bytes after the last tensor (corrupt file)")
    return tensors


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


def read_chunks(f, start: int, nbytes: int):
    """Yield ``(offset, memoryview)`` chunks covering bytes ``[start, start + nbytes)`` of the
    open file ``f``.

    Large ranges come from read-only mmap windows of at most CHUNK_BYTES: hashing straight
    from the page cache saves a user-space copy, and unmapping each window keeps resident
    memory bounded. Each view is valid only until the next one is requested."""
    size = os.fstat(f.fileno()).st_size
    if start + nbytes > size:
        raise ConversionError(f"{f.name}: file shrank to {size} bytes while converting")
    if nbytes < SMALL_READ_BYTES:
        yield start, memoryview(os.pread(f.fileno(), nbytes, start))
        return
    pos, end = start, start + nbytes
    while pos < end:
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        length = min(end, base + CHUNK_BYTES) - base
        with mmap.mmap(f.fileno(), length, offset=base, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)[pos - base:]
            try:
                yield pos, view
            finally:
                view.release()
        pos = base + length


class SourceFiles:
    """The open source files, by path."""

    def __init__(self):
        self._files = {}

    def open(self, path: Path):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb")
        return f

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


class OutFile:
    """An output file that hashes every byte it receives.

    Source ranges are copied by the kernel (``os.sendfile``: faster than ``write`` from user
    memory, docs/measurements.md) while a helper thread hashes the same
    bytes from a read-only mapping, so the data never passes through Python and copying
    overlaps hashing."""

    def __init__(self, path: Path, hasher: ThreadPoolExecutor):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._sha = hashlib.sha256()
        self._hasher = hasher
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._sha.update(data)
        self.size += len(data)

    def copy_range(self, f, start: int, nbytes: int) -> None:
        for pos, view in read_chunks(f, start, nbytes):
            if len(view) < SMALL_READ_BYTES:
                self.write(view)
                continue
            hashed = self._hasher.submit(self._sha.update, view)
            try:
                done = 0
                while done < len(view):
                    sent = os.sendfile(self._fd, f.fileno(), pos + done, len(view) - done)
                    if sent == 0:
                        raise ConversionError(f"{f.name}: file shrank while converting")
                    done += sent
            finally:
                hashed.result()          # the window is unmapped after this iteration
            self.size += len(view)

    def close(self) -> tuple[int, str]:
        os.close(self._fd)
        return self.size, self._sha.hexdigest()


def write_safetensors(path: Path, tensors: list[OutTensor], metadata: dict[str, str],
                      files: SourceFiles, on_bytes=None) -> tuple[int, str]:
    """Stream ``tensors`` (in the given order) into ``path``; returns (size, sha256)."""
    with ThreadPoolExecutor(1) as hasher:
        out = OutFile(path, hasher)
        try:
            out.write(header_bytes(tensors, metadata))
            for t in tensors:
                for src in t.sources:
                    out.copy_range(files.open(src.file), src.start, src.nbytes)
                    if on_bytes is not None:
                        on_bytes(src.nbytes)
        finally:
            size, sha = out.close()
    return size, sha


def sha256_file(path: Path, stop=None) -> tuple[int, str]:
    """(size, sha256) of a file; ``stop()`` returning True abandons the work early."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for _, chunk in read_chunks(f, 0, size):
            if stop is not None and stop():
                raise ConversionError(f"{path}: hashing stopped")
            sha.update(chunk)
    return size, sha.hexdigest()
