"""A converted directory as the runtime reads it: the weight files (which ones, and their check
against the receipt, are checkpoint/integrity.py's) and the weight-load gate (every tensor a model holds
compared with the bytes in the file, read again by an independent parser). The layout itself is
converter/layout.py's."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoint.integrity import CheckpointError, Reads, checkpoint_files
from ..converter.errors import ConversionError
from ..converter.layout import GROUP_SIZE
from ..converter.omni import renamer
from ..converter.safetensors_io import header_of, open_regular, read_chunks, read_header
from .quant import DenseExperts, ScaledLinear


def read_weights(path: str, reads: Reads | None = None, keep=None) -> tuple[dict, dict]:
    """All tensors of the checkpoint's weight files (integrity.checkpoint_files), and which file
    each came from; with ``keep``, only the names it accepts. A tensor in two files is refused:
    a stray copy never overrides another. ``reads`` (integrity.check_checkpoint,
    recorded.check_files): the hashes each file's bytes are checked against as they are read,
    so the tensors are made from the very bytes that were checked. An Omni wrapper gives its
    text tower under the plain names; its media tensors are left unread (``mx.load`` reads a
    tensor only when it is evaluated)."""
    reads = Reads() if reads is None else reads
    weights, origin, rename = {}, {}, renamer(path)

    def wanted(name):
        return rename(name) is not None and (keep is None or keep(rename(name)))
    for f in checkpoint_files(path):
        for k, v in read_file(f, reads.get(f), wanted).items():
            k = rename(k)
            if k in origin:
                raise CheckpointError(f"{f}: tensor {k} is also in {origin[k]}")
            weights[k] = v
            origin[k] = f
    reads.done()
    return weights, origin


MLX_DTYPES = {"BOOL", "U8", "I8", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
              "I64", "U64"}
"""The safetensors dtypes ``mx.load`` reads (F8_E4M3 as its bytes)."""


def read_file(f: str, reading=None, keep=None) -> dict:
    """The tensors of one safetensors file (with ``keep``, those it accepts), its header checked
    whole first (converter/safetensors_io.header_of: no name twice, no overlapping or stray
    bytes). MLX reads the file this function opened (its descriptor, whatever the name
    points to by then); with ``reading`` (integrity.Reading) each tensor is read at once and
    the bytes MLX holds, in file order after the header's, are what is hashed."""
    try:
        with open_regular(Path(f)) as fh:
            try:
                infos, head = header_of(fh, Path(f))
            except ConversionError:
                if reading is not None:       # a file changed since its hashes is named so
                    for pos, view in read_chunks(fh, 0, os.fstat(fh.fileno()).st_size):
                        reading.feed(pos, view)
                raise
            odd = next((t for t in infos.values() if t.dtype not in MLX_DTYPES), None)
            if odd is not None:
                raise CheckpointError(f"{f}: tensor {odd.name!r} is {odd.dtype}, a dtype MLX "
                                      f"does not load")
            try:
                loaded = mx.load(f"/dev/fd/{fh.fileno()}", format="safetensors")
            except Exception as e:  # MLX reports unreadable files with various types
                raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
            out = {n: a for n, a in loaded.items() if keep is None or keep(n)}
            if reading is None:
                return out                    # read lazily, as the model converts them
            reading.feed(0, head)
            for t in sorted(infos.values(), key=lambda t: t.start):
                if t.name in out or reading.wants(t.start, t.nbytes):
                    reading.feed(t.start, memoryview(loaded[t.name].reshape(-1).view(mx.uint8)))
            reading.finish()
            return out
    except ConversionError as e:
        raise CheckpointError(str(e)) from None


_FLOATS = (mx.bfloat16, mx.float16, mx.float32)


_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
              "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
              "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F8_E4M3": np.uint8,
              "BOOL": np.bool_}


def read_raw_safetensors(f: str) -> dict:
    """name -> (safetensors dtype string, numpy array of the stored bits), through a memory
    map of the file (independent of the loader's reads, so the gate checks one with the
    other), its header checked whole."""
    try:
        infos = read_header(Path(f))
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    data = np.memmap(f, dtype=np.uint8, mode="r")
    return {name: (t.dtype, data[t.start:t.start + t.nbytes].view(_ST_DTYPES[t.dtype])
                   .reshape(t.shape)) for name, t in infos.items()}


def _e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 E4M3 bytes (bias 7, subnormals, 0x7F/0xFF = NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7) / 8.0
    v = np.where(e == 0, m * 2.0 ** -6, (1 + m) * 2.0 ** (e - 7.0))
    v[(e == 15) & (b & 7 == 7)] = np.nan
    return np.where(b & 0x80, -v, v).astype(np.float32)


_E4M3 = _e4m3_values()
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _decode(st_dtype: str, arr: np.ndarray) -> np.ndarray | None:
    """A stored float tensor as float32 values (exact), or None for non-float storage."""
    if st_dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if st_dtype in ("F16", "F32"):
        return arr.astype(np.float32)
    return None


def _decode_nvfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 code x E4M3 block scale (no tensor scale) as float32; exact. Codes: 8 per uint32,
    element i in bits 4i..4i+3, i.e. low nibble first in little-endian bytes."""
    b = codes.view(np.uint8)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(codes.shape[0], -1)
    return _E2M1[nib] * np.repeat(_E4M3[scales], GROUP_SIZE, axis=-1)


def _same(want: np.ndarray, got: mx.array) -> bool:
    """``got`` equals the file's values: bit for bit for integer storage; for floats, the exact
    file values converted to ``got``'s dtype (a no-op unless the model computes in a narrower
    dtype than the file stores)."""
    if tuple(want.shape) != tuple(got.shape):
        return False
    if want.dtype.kind in "uib":
        return np.array_equal(np.array(got), want)
    want = mx.array(want).astype(got.dtype)
    return bool(mx.array_equal(want, got, equal_nan=True).item())


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


def _stacked(stored: dict) -> dict:
    """Per-expert tensors of an unconverted checkpoint (``experts.{e}.up_proj.weight``) as the
    stacked ones the model holds (``experts.up_proj.weight``), in expert order."""
    groups = {}
    for name in [n for n in stored if _EXPERT.match(n)]:
        m = _EXPERT.match(name)
        groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = name
    for name, parts in groups.items():
        if sorted(parts) == list(range(len(parts))):
            rows = [stored.pop(parts[e]) for e in range(len(parts))]
            stored[name] = (rows[0][0], rows[0][1], np.stack([r[2] for r in rows]))
    return stored


def weight_gate(drafter: nn.Module, path: str, prefix: str = "") -> str:
    """Compare every tensor of the checkpoint whose name starts with ``prefix`` (the drafter's
    parameter names, ``prefix`` removed) with what ``drafter`` holds; raise on any mismatch
    or when nothing was comparable. Returns the report ``"k/k tensors match"``. A model that
    borrows its embedding has a ``shared_embedding()`` method returning the borrowed table."""
    stored, rename = {}, renamer(path)
    for f in checkpoint_files(path):
        for name, (st_dtype, arr) in read_raw_safetensors(f).items():
            name = rename(name)
            if name is not None and name.startswith(prefix):
                stored[name[len(prefix):]] = (f, st_dtype, arr)
    stored = _stacked(stored)
    params = dict(tree_flatten(drafter.parameters()))
    checks = []  # (checkpoint tensors, their values, model parameter)
    used = set()  # model parameters checked by a decoding rule
    absent = []  # model parameters with no counterpart in the checkpoint
    for module, m in drafter.named_modules():
        if not isinstance(m, ScaledLinear) and not (isinstance(m, DenseExperts) and "scale" in m):
            continue
        used |= {f"{module}.weight", f"{module}.scale"}
        # NVFP4 decoded at load (weight = e2m1 x e4m3, scale = ws2), or FP8 decoded at load
        nvfp4 = f"{module}.scales" in stored
        names = [f"{module}.weight", f"{module}.scales"] if nvfp4 else [f"{module}.weight"]
        scale = f"{module}.weight_scale_2" if nvfp4 else f"{module}.weight_scale"
        if any(n not in stored for n in (*names, scale)):
            absent.append(module)
            continue
        codes = stored[names[0]][2]
        want = _decode_nvfp4(codes, stored[names[1]][2]) if nvfp4 else _E4M3[codes]
        checks.append((names, want, m.weight))
        checks.append(([scale], _decode(*stored[scale][1:]), m.scale))
    for name, p in params.items():
        if name in used:
            continue
        if name not in stored:
            absent.append(name)
            continue
        f, st_dtype, arr = stored[name]
        checks.append(([name], _decode(st_dtype, arr) if p.dtype in _FLOATS else arr, p))
    if "embed_tokens.weight" in stored and "embed_tokens.weight" not in params:
        # Shared with the target: what the target's embedding returns must be the file's.
        f, st_dtype, arr = stored["embed_tokens.weight"]
        checks.append((["embed_tokens.weight"], _decode(st_dtype, arr), drafter.shared_embedding()))

    matched, bad, seen = 0, [], set()
    for names, want, got in checks:
        seen.update(names)
        if want is not None and _same(want, got):
            matched += len(names)
        else:
            bad.append(f"{'+'.join(prefix + n for n in names)} ({stored[names[0]][0]}): "
                       f"loaded values differ from the file")
    bad += [f"{prefix}{n} ({stored[n][0]}): not loaded into the drafter"
            for n in sorted(set(stored) - seen)]
    bad += [f"{prefix}{n}: in the drafter but not in the checkpoint" for n in absent]
    if matched == 0:
        raise CheckpointError(f"{path}: weight-load gate refused the drafter: no tensor could be "
                               f"compared with the checkpoint ({len(bad)} problem(s))")
    if bad:
        raise CheckpointError(f"{path}: weight-load gate refused the drafter: {len(bad)} problem(s): "
                               + "; ".join(bad[:5]))
    return f"{matched}/{len(stored)} tensors match"


def through_gate(drafter: nn.Module, path: str, verbose: bool = False, prefix: str = ""):
    """``drafter`` with its parameters evaluated and passed through :func:`weight_gate`
    (``drafter.gate_report`` set; printed with ``verbose``)."""
    mx.eval(drafter.parameters())
    drafter.gate_report = weight_gate(drafter, path, prefix)
    if verbose:
        print(f"drafter {prefix + 'from ' if prefix else ''}{path}: {drafter.gate_report}")
    return drafter


def shared_embedding(target, vocab: int) -> mx.array:
    """The target's embedding table, read through ``target.embed`` in chunks (what a drafter
    that borrows it holds, for the gate)."""
    return mx.concatenate([target.embed(mx.arange(s, min(s + 8192, vocab)))
                           for s in range(0, vocab, 8192)])


def _embedding_identical(own: mx.array, target) -> bool:
    v = own.shape[0]
    for s in range(0, v, 8192):
        ids = mx.arange(s, min(s + 8192, v))
        t = target.embed(ids)
        if not mx.array_equal(t.astype(mx.float32), own[ids].astype(mx.float32)).item():
            return False
    return True
