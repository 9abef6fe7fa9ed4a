"""Linear layers over the converted checkpoint layout (converter/layout.py).

A converted module at prefix ``P`` is one of:

* ``nvfp4``: ``P.weight`` uint32 ``(out, in/8)`` (ModelOpt's nibbles, byte for byte),
  ``P.scales`` uint8 ``(out, in/16)`` (raw E4M3 block scales) and ``P.weight_scale_2``
  float32 ``()`` (ModelOpt's per-tensor scale, verbatim). Stacked experts add a leading
  ``E`` axis everywhere, so the tensor scale becomes ``(E,)``.
* ``fp8``: ``P.weight`` uint8 ``(out, in)`` (raw E4M3 bits) and ``P.weight_scale`` float32 ``()``.
* ``dense``: ``P.weight`` in its source dtype.

The tensor scales are applied to the matmul *output*: ``x @ (q * s)^T == (x @ q^T) * s``
is exact algebra, so nothing is re-rounded into the stored scales.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUP_SIZE = 16


def fp8_e4m3_to_float(raw: mx.array, dtype=mx.float32) -> mx.array:
    """Decode raw E4M3 bytes. Every E4M3 value is exact in bf16, fp16 and fp32."""
    return mx.from_fp8(raw, dtype=dtype)


class NVFP4Linear(nn.Module):
    def __init__(self, weight, scales, weight_scale_2, bias=None):
        super().__init__()
        self.weight = weight
        self.scales = scales
        self.weight_scale_2 = weight_scale_2
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        y = mx.quantized_matmul(
            x, self.weight, self.scales, transpose=True,
            group_size=GROUP_SIZE, bits=4, mode="nvfp4",
        )
        y = y * self.weight_scale_2.astype(y.dtype)
        if "bias" in self:
            y = y + self.bias
        return y

    def dequantized(self, dtype=mx.float32) -> mx.array:
        """The exact float weight: e2m1 · e4m3 block scale · tensor scale (in fp32)."""
        w = mx.dequantize(self.weight, self.scales, group_size=GROUP_SIZE, bits=4,
                          mode="nvfp4", dtype=mx.float32)
        return (w * self.weight_scale_2).astype(dtype)


class FP8Linear(nn.Module):
    """Per-tensor FP8 weights decoded once at load (exact in any float dtype); the
    per-tensor scale multiplies the output."""

    def __init__(self, weight_fp8, weight_scale, dtype=mx.bfloat16, bias=None):
        super().__init__()
        self.weight = fp8_e4m3_to_float(weight_fp8, dtype)
        self.weight_scale = weight_scale
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        y = (x @ self.weight.T) * self.weight_scale.astype(x.dtype)
        if "bias" in self:
            y = y + self.bias
        return y


def module_format(weights: dict, prefix: str) -> str:
    """Which of the three layouts the tensors under ``prefix`` use."""
    if f"{prefix}.scales" in weights:
        return "nvfp4"
    if f"{prefix}.weight_scale" in weights:
        return "fp8"
    return "dense"


def make_linear(weights: dict, prefix: str, dtype=mx.float32) -> nn.Module:
    """Build the linear layer stored under ``prefix`` from a flat tensor dict.

    ``dtype`` is the compute dtype: activations, dense weights and decoded FP8 weights
    use it; NVFP4 codes and scales stay packed."""
    bias = weights.get(f"{prefix}.bias")
    if bias is not None:
        bias = bias.astype(dtype)
    fmt = module_format(weights, prefix)
    if fmt == "nvfp4":
        return NVFP4Linear(weights[f"{prefix}.weight"], weights[f"{prefix}.scales"],
                           weights[f"{prefix}.weight_scale_2"].astype(mx.float32), bias)
    if fmt == "fp8":
        return FP8Linear(weights[f"{prefix}.weight"], weights[f"{prefix}.weight_scale"]
                         .astype(mx.float32), dtype, bias)
    w = weights[f"{prefix}.weight"].astype(dtype)
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    layer.weight = w
    if bias is not None:
        layer.bias = bias
    return layer
