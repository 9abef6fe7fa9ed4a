"""Ways to spoil a snapshot file of a prompt cache directory (tests and
``benchmarks/bench_prompt_cache.py``): each leaves something a store must refuse."""

from __future__ import annotations

import json
import os
import shutil
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
    from mlx_dspark.prompt_cache.disk import _header, read_snapshot, write_snapshot
    ident = json.loads(_header(path)[0]["identity"])
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


WAYS = {"corrupt": corrupt, "truncated": truncated, "foreign": foreign,
        "symlinked": symlinked, "other-user": other_user}
