"""Ways to spoil a snapshot file of a prompt cache directory (tests and
``benchmarks/bench_prompt_cache.py``): each leaves something a store must refuse."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile


def corrupt(path):
    """Flip one bit near the end of the data."""
    with open(path, "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 1]))


def truncated(path):
    """Cut the file's last 100 bytes (a write that never finished)."""
    os.truncate(path, os.path.getsize(path) - 100)


def foreign(path):
    """The same snapshot, rewritten as another model's (an intact file, wrong identity)."""
    from mlx_dspark.prompt_cache.snapshot_file import read_snapshot, write_snapshot
    ident = json.loads(read_header(path)[0]["__metadata__"]["identity"])
    snap, _ = read_snapshot(path, ident)
    write_snapshot(path, snap, dict(ident, model="0" * 64), "")


def symlinked(path):
    """The intact file moved elsewhere and reached through a symlink."""
    elsewhere = os.path.join(tempfile.mkdtemp(), "snapshot.safetensors")
    shutil.move(path, elsewhere)
    os.symlink(elsewhere, path)


def other_user(path):
    """The file handed to another user (needs root)."""
    os.chown(path, 12345, 12345)


def renamed_tensor(path):
    """One bit of a tensor's name flipped in the header: ``t.0.ssm`` becomes ``t.0.rsm``
    (the first Mamba layer's SSM state, absent under its own name)."""
    flip_in_header(path, b'"t.0.ssm"', 3, 0x01)


def renamed_key(path):
    """One bit of the ``data_offsets`` key of a layer's tensor flipped (``data_offsetr``)."""
    flip_in_header(path, b'"data_offsets"', 12, 0x01, after=b'"t.0.ssm"')


WAYS = {"corrupt": corrupt, "truncated": truncated, "foreign": foreign,
        "symlinked": symlinked, "other-user": other_user, "renamed-tensor": renamed_tensor,
        "renamed-key": renamed_key}


# ------------------------------------------------------------------------ header surgery


def read_header(path) -> tuple[dict, bytes]:
    """A snapshot file's header, parsed, and its data section."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), fh.read()


def flip_in_header(path, text: bytes, at: int, mask: int, after: bytes = b""):
    """XOR byte ``at`` of the first ``text`` in the file (after the first ``after``) with
    ``mask``: a bit flipped in the header, nothing else changed."""
    with open(path, "r+b") as fh:
        raw = fh.read()
        where = raw.index(text, raw.index(after) if after else 0) + at
        fh.seek(where)
        fh.write(bytes([raw[where] ^ mask]))


def rewrite(path, header: dict, data: bytes, reseal: bool = True):
    """Write ``header`` and ``data`` as the file ``path``; ``reseal``: with the checksum of
    what is written, as a faulty or hostile writer of this format would (only the checks
    beyond the checksum can refuse it)."""
    from mlx_dspark.prompt_cache.snapshot_file import canonical, seal
    if reseal:
        seal(header, [data])
    head = canonical(header)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head + data)
