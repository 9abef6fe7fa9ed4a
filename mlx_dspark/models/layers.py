"""Small pieces any model over the converted layout uses: ``Norm`` (an RMSNorm whose weight a
checkpoint names) and ``CompiledPerKey`` (compiled functions kept per setting, bounded)."""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn

from ..kernels.norm import rms_norm


class Norm(nn.Module):
    """RMSNorm over the last axis with the checkpoint's ``weight`` (kernels.norm.rms_norm)."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight, self.eps)


class CompiledPerKey:
    """``mx.compile(fn)`` once per key, the ``keep`` most recently used kept. MLX caches a
    compiled graph per value of each non-array argument (a request's temperature), for as long
    as the compiled function lives: one per key, dropped when evicted, bounds what a server
    that sees a new setting in every request holds."""

    def __init__(self, fn, keep: int):
        self.fn, self.keep = fn, keep
        self.compiled: OrderedDict = OrderedDict()

    def __call__(self, key, *args):
        fn = self.compiled.pop(key, None) or mx.compile(self.fn)
        self.compiled[key] = fn
        if len(self.compiled) > self.keep:
            self.compiled.popitem(last=False)
        return fn(*args)
