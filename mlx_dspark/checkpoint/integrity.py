"""A converted directory checked against its receipt before it is loaded, and the weight files
a load reads (those the receipt lists: never a pattern over the user's path, never a stray
extra file).

The receipt (``MERERUN_CONVERSION.json``) records each output file's size and SHA-256, and for
weight files the SHA-256 of every ``RECEIPT_BLOCK_BYTES`` block. ``verify`` picks how much is
hashed at load (docs/integrity.md measures each level):

* ``"full"``: every listed file, every byte;
* ``"fast"``: every size; the small files in full; of each weight file the blocks holding its
  safetensors header and its last block, plus ``FAST_SAMPLES`` blocks drawn at random per load
  (so repeated loads cover different parts). A file whose receipt has no blocks (an older
  converter) is hashed in full;
* ``"auto"`` (default): ``"full"`` up to ``FULL_AUTO_BYTES`` listed, else ``"fast"``;
* ``"none"``: no receipt read, nothing hashed: the explicit opt-out for a directory without one.

MLX-free, so ``mlx-dspark verify`` starts quickly."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import random
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..converter.layout import RECEIPT_NAME, WEIGHT_FILES, load_receipt, weight_files

VERIFY_LEVELS = ("auto", "full", "fast", "none")
FULL_AUTO_BYTES = 1 << 30
"""Largest checkpoint ``"auto"`` hashes in full, where that stays cheap next to loading it
(docs/integrity.md); the 19 GB Nemotron target gets ``"fast"``."""
FAST_SAMPLES = 8
READ_BYTES = 4 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A converted checkpoint that cannot be used (bad file, unsupported variant, wrong target)."""


@dataclass(frozen=True)
class Output:
    """One file the receipt lists."""
    name: str
    size: int
    sha256: str
    block_size: int = 0
    blocks: tuple[str, ...] = ()


def check_level(verify) -> str:
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify={verify!r}: must be one of {', '.join(VERIFY_LEVELS)}")
    return verify


def receipt_outputs(path) -> list[Output] | None:
    """The files the receipt lists, validated; None when the directory has no receipt."""
    where = os.path.join(path, RECEIPT_NAME)
    try:
        receipt = load_receipt(path)
        if receipt is None:
            return None
        outputs = receipt["outputs"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{where}: unreadable conversion receipt ({e})") from None
    if not isinstance(outputs, dict) or not outputs:
        raise CheckpointError(f"{where}: malformed receipt: \"outputs\" must be a non-empty "
                              f"object of file name -> size and sha256")
    return [_output(where, name, entry) for name, entry in sorted(outputs.items())]


def _output(where: str, name: str, entry) -> Output:
    def bad(what):
        return CheckpointError(f"{where}: malformed receipt: outputs[{name!r}] {what}")

    if name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
        raise bad("is not a file name in the directory")
    if not isinstance(entry, dict):
        raise bad("must be an object with size and sha256")
    size, sha = entry.get("size"), entry.get("sha256")
    if type(size) is not int or size < 0:
        raise bad(f"size must be a non-negative integer, not {size!r:.40}")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise bad(f"sha256 must be 64 lowercase hex digits, not {sha!r:.80}")
    blocks = entry.get("blocks")
    if blocks is None:
        return Output(name, size, sha)
    bsize = blocks.get("size") if isinstance(blocks, dict) else None
    hashes = blocks.get("sha256") if isinstance(blocks, dict) else None
    if type(bsize) is not int or bsize <= 0 or not isinstance(hashes, list) \
            or len(hashes) != -(-size // bsize) \
            or not all(isinstance(h, str) and _SHA256.fullmatch(h) for h in hashes):
        raise bad("blocks must be {\"size\": block bytes, \"sha256\": one hash per block}")
    return Output(name, size, sha, bsize, tuple(hashes))


def check_checkpoint(path, verify: str = "auto", require_receipt: bool = True) -> "Reads":
    """Check ``path`` against its receipt at the level ``verify`` names: its small files now,
    its weight files as the load reads them (the :class:`Reads` returned, for
    models/weights.read_weights). A directory without a receipt is refused unless
    ``verify="none"`` or ``require_receipt`` is False (a plain Hugging Face directory, which
    no converter vouched for); nothing is checked then (an empty :class:`Reads`)."""
    path = str(path)
    if check_level(verify) == "none":
        return Reads()
    outputs = receipt_outputs(path)
    if outputs is None:
        if require_receipt:
            raise CheckpointError(
                f"{path}: no conversion receipt ({RECEIPT_NAME}), so its files cannot be "
                f"checked; re-convert it with `mlx-dspark convert`, or load it unchecked with "
                f"verify=\"none\" (command line: --verify none)")
        return Reads()
    return verify_outputs(path, outputs, verify, loading=True)


def checkpoint_files(path) -> list[str]:
    """The weight files a load reads: those the receipt lists; without a readable receipt
    (only reached with ``verify="none"`` or a plain Hugging Face directory), the directory's
    ``model*.safetensors``."""
    path = str(path)
    try:
        outputs = receipt_outputs(path)
    except CheckpointError:
        outputs = None
    if outputs is None:
        files = weight_files(path)
    else:
        files = [os.path.join(path, o.name) for o in outputs
                 if fnmatch.fnmatchcase(o.name, WEIGHT_FILES)]
    if not files:
        raise CheckpointError(f"{path}: no {WEIGHT_FILES} files"
                              + (f" listed in {RECEIPT_NAME}" if outputs is not None else ""))
    return files


RECEIPT_WORDS = ("the conversion receipt", "after conversion")
"""What the expected hashes are called in a message, and since when a change happened."""


class Reading:
    """One weight file's expected hashes (its spans: whole, or the blocks the level picked),
    checked against the bytes a load reads from it, fed in file order (:meth:`feed`): what
    is checked is what is loaded, whatever happens to the file between."""

    def __init__(self, f: str, spans: list, words: tuple[str, str]):
        self.f, self.words = f, words
        self.spans = sorted((start, length, want, block) for _, start, length, want, block
                            in spans)
        self._i, self._sha = 0, hashlib.sha256()

    def wants(self, start: int, length: int) -> bool:
        """Whether bytes ``[start, start + length)`` are part of a span still to check."""
        return any(s < start + length and start < s + n for s, n, _, _ in self.spans[self._i:])

    def feed(self, pos: int, data) -> None:
        """Bytes ``[pos, pos + len(data))`` of the file, as loaded; a span whose last byte
        arrives is compared at once."""
        view = memoryview(data).cast("B")
        end = pos + len(view)
        while self._i < len(self.spans):
            start, length, want, block = self.spans[self._i]
            if start >= end and length:
                return
            lo, hi = max(start, pos), min(start + length, end)
            if lo < hi:
                self._sha.update(view[lo - pos:hi - pos])
            if start + length > end:
                return
            got, self._sha = self._sha.hexdigest(), hashlib.sha256()
            self._i += 1
            if got != want:
                raise CheckpointError(_differs(self.f, start, start + length, block, got, want,
                                               self.words))

    def finish(self) -> None:
        self.feed(0, b"")                         # spans of no bytes
        if self._i < len(self.spans):
            raise CheckpointError(f"{self.f}: not read to the end of what "
                                  f"{self.words[0]} records (the file shrank?)")


class Reads(dict):
    """The checks a load's reads of weight files go through: file path -> :class:`Reading`
    (a file not in it is not checked); :meth:`done` once every file is read."""

    def done(self) -> None:
        pass


def verify_outputs(path: str, outputs: list[Output], verify: str = "full",
                   words: tuple[str, str] = RECEIPT_WORDS, loading: bool = False) -> Reads:
    """Raise CheckpointError naming the first file (and block) that differs from the receipt
    (or, with other ``words``, from the hashes recorded at a first load). With ``loading``
    the weight files are only sized now: their hashes are checked on the bytes the load
    reads (the :class:`Reads` returned)."""
    against, since = words
    if verify == "auto":
        verify = "full" if sum(o.size for o in outputs) <= FULL_AUTO_BYTES else "fast"
    jobs, optional = [], []      # (file, start, length, expected sha256, block index or None)
    for o in outputs:
        f = os.path.join(path, o.name)
        try:
            st = os.stat(f)
        except OSError as e:
            raise CheckpointError(f"{f}: listed in {against} but "
                                  f"{'missing' if isinstance(e, FileNotFoundError) else e.strerror}"
                                  ) from None
        if not stat.S_ISREG(st.st_mode):     # a FIFO would hang the hashing
            raise CheckpointError(f"{f}: not a regular file")
        size = st.st_size
        if size != o.size:
            raise CheckpointError(f"{f}: {size} bytes, {against} records {o.size}: "
                                  f"the file changed {since}")
        if not o.blocks:
            jobs.append((f, 0, o.size, o.sha256, None))
            continue
        spans = [(f, i * o.block_size, min(o.block_size, o.size - i * o.block_size), h, i)
                 for i, h in enumerate(o.blocks)]
        if verify == "full":
            jobs += spans
            continue
        first = set(range(_header_blocks(f, o))) | {len(spans) - 1}
        jobs += [spans[i] for i in sorted(first)]
        optional += [s for i, s in enumerate(spans) if i not in first]
    jobs += random.SystemRandom().sample(optional, min(FAST_SAMPLES, len(optional)))
    reads = Reads()
    if loading:
        weights = {os.path.join(path, o.name) for o in outputs
                   if fnmatch.fnmatchcase(o.name, WEIGHT_FILES)}
        for f in weights:
            reads[f] = Reading(f, [j for j in jobs if j[0] == f], words)
        jobs = [j for j in jobs if j[0] not in weights]
    pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1))
    try:
        for problem in pool.map(_check_span, jobs):
            if problem:
                raise CheckpointError(problem.replace(RECEIPT_WORDS[0], against)
                                      .replace(RECEIPT_WORDS[1], since))
    finally:
        pool.shutdown(cancel_futures=True)   # the first difference is enough
    return reads


def _header_blocks(f: str, o: Output) -> int:
    """How many leading blocks hold the safetensors header (all of them if it is garbled)."""
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror or e})") from None
    return -(-min(8 + n, o.size) // o.block_size)


def _check_span(job) -> str | None:
    f, start, length, want, block = job
    sha, end = hashlib.sha256(), start + length
    try:
        with open(f, "rb") as fh:
            pos = start
            while pos < end:
                chunk = os.pread(fh.fileno(), min(READ_BYTES, end - pos), pos)
                if not chunk:
                    return f"{f}: file shrank while it was being checked"
                sha.update(chunk)
                pos += len(chunk)
    except OSError as e:
        return f"{f}: cannot read ({e.strerror or e})"
    got = sha.hexdigest()
    return None if got == want else _differs(f, start, end, block, got, want)


def _differs(f, start, end, block, got, want, words=RECEIPT_WORDS) -> str:
    what = "sha256" if block is None else f"block {block} (bytes {start}-{end - 1}) sha256"
    return (f"{f}: {what} {got} differs from {words[0]} ({want}): the file changed "
            f"{words[1]}")


def verify_directory(path) -> str:
    """``mlx-dspark verify``: every byte of every listed file; the one-line report."""
    path = str(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    outputs = receipt_outputs(path)
    if outputs is None:
        raise CheckpointError(f"{path}: no conversion receipt ({RECEIPT_NAME}) to check against")
    verify_outputs(path, outputs, "full")
    total = sum(o.size for o in outputs)
    return (f"{path}: intact: {len(outputs)} files, {total / 1e6:.1f} MB match the conversion "
            f"receipt (SHA-256)")
