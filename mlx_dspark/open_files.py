"""The process's open-file limit: raised when a command needs more descriptors, never past
the hard limit (which an unprivileged process cannot raise back).

mlx-lm sets ``RLIMIT_NOFILE`` to (2048, 4096) when imported: that fails at import under a hard
limit below 4096 (every command crashed) and lowers a higher hard limit for good. mlx-lm is
imported through :func:`import_mlx_lm`, which turns that call into :func:`raise_limit`."""

from __future__ import annotations

import contextlib
import importlib
import os
import resource

NOFILE = resource.RLIMIT_NOFILE
_setrlimit = resource.setrlimit     # the real one, while an import runs with the clamped one


def raise_limit(want: int) -> int:
    """Raise the soft limit toward ``want`` as far as the hard limit allows (never lower
    either); returns the soft limit now."""
    soft, hard = resource.getrlimit(NOFILE)
    if soft == resource.RLIM_INFINITY:
        return want
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        _setrlimit(NOFILE, (target, hard))
        soft = target
    return soft


def in_use() -> int:
    """How many descriptors the process holds now (the weights' files, pipes, logs, the
    listening socket...); 64 where the platform cannot say."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 64


@contextlib.contextmanager
def _clamped():
    def clamped(which, limits):
        if which != NOFILE:
            return _setrlimit(which, limits)
        raise_limit(limits[0])

    resource.setrlimit = clamped
    try:
        yield
    finally:
        resource.setrlimit = _setrlimit


def import_mlx_lm(name: str):
    """``importlib.import_module(name)`` for an ``mlx_lm`` module, its open-file limit
    change clamped to what the hard limit allows."""
    with _clamped():
        return importlib.import_module(name)
