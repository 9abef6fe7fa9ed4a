"""Linear layers over the converted checkpoint layout (converter/layout.py).

A converted module at prefix ``P`` is one of:

* ``nvfp4``: ``P.weight`` uint32 ``(out, in/8)`` (ModelOpt's nibbles, byte for byte),
  ``P.scales`` uint8 ``(out, in/16)`` (raw E4M3 block scales) and ``P.weight_scale_2``
  float32 ``()`` (ModelOpt's per-tensor scale, verbatim). Stacked experts add a leading
  ``E`` axis everywhere, so the tensor scale becomes ``(E,)``.
* ``fp8``: ``P.weight`` uint8 ``(out, in)`` (raw E4M3 bits) and ``P.weight_scale`` float32 ``()``.
* ``dense``: ``P.weight`` in its source dtype.

The tensor scales are applied to the matmul *output*: ``x @ (q * s)^T == (x @ q^T) * s``
is exact algebra, so nothing is re-rounded into the stored scales. The product before the
scale is large (E2M1 up to 6 times an E4M3 block scale up to 448, summed over the inputs: 7e4
on the demo target, whose tensor scales are ~2e-4), beyond float16's 65504, so in a float16
model these layers accumulate in float32 (:func:`accumulation_dtype`), as NVIDIA's kernels
apply the tensor scale to a float32 accumulator; bf16 and fp32 have the range and stay as
they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..converter.layout import GROUP_SIZE
from ..device import accumulation_dtype, on_gpu


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
            x.astype(accumulation_dtype(x.dtype)), self.weight, self.scales, transpose=True,
            group_size=GROUP_SIZE, bits=4, mode="nvfp4",
        )
        y = (y * self.weight_scale_2.astype(y.dtype)).astype(x.dtype)
        if "bias" in self:
            y = y + self.bias
        return y

    def dequantized(self, dtype=mx.float32) -> mx.array:
        """The exact float weight: e2m1 · e4m3 block scale · tensor scale (in fp32)."""
        w = mx.dequantize(self.weight, self.scales, group_size=GROUP_SIZE, bits=4,
                          mode="nvfp4", dtype=mx.float32)
        return (w * self.weight_scale_2).astype(dtype)


class ScaledLinear(nn.Module):
    """A float weight times a per-tensor scale on the output: FP8 decoded at load, or NVFP4
    dequantized once (``nvfp4="dequantized"``, see :data:`NVFP4_POLICY`). Decoding is exact:
    every E4M3 value, and every E2M1·E4M3 product, is representable in bf16/fp16/fp32; the
    tensor scale stays a separate float32 factor, as in the quantized path."""

    def __init__(self, weight, scale, bias=None):
        super().__init__()
        self.weight = weight
        self.scale = scale
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        w = self.weight      # decoded in the accumulation dtype (make_linear)
        y = ((x.astype(w.dtype) @ w.T) * self.scale.astype(w.dtype)).astype(x.dtype)
        if "bias" in self:
            y = y + self.bias
        return y


def FP8Linear(weight_fp8, weight_scale, dtype=mx.bfloat16, bias=None) -> ScaledLinear:
    """Per-tensor FP8: decoded once at load (exact in any float dtype); the per-tensor scale
    multiplies the output. Decoding per call instead is several times slower on the CPU
    (docs/history/measurements.md), at 2x (bf16) or 4x (fp32) the FP8 weight memory."""
    return ScaledLinear(fp8_e4m3_to_float(weight_fp8, dtype), weight_scale, bias)


def dequantize_nvfp4(weight, scales, dtype=mx.float32) -> mx.array:
    """e2m1 · e4m3 without the tensor scale: exact in bf16, fp16 and fp32."""
    return mx.dequantize(weight, scales, group_size=GROUP_SIZE, bits=4, mode="nvfp4",
                         dtype=dtype)


NVFP4_POLICY = "quantized"
"""Default compute for NVFP4 linears: ``"quantized"`` (``mx.quantized_matmul`` on the packed
codes) on every backend. With MLX's stock CPU BLAS the quantized kernel beats a dense matmul
over weights decoded at load at every block size; with OpenBLAS preloaded it still wins for 1
token but loses for 4-8, so ``nvfp4="dequantized"`` pays for verify-heavy (speculative)
decoding there, at 4x (fp32) the weight memory. bf16 activations make the CPU kernel several
times slower: the CPU default dtype is float32 (target.default_dtype). Numbers:
docs/history/measurements.md."""


def module_format(weights: dict, prefix: str) -> str:
    """Which of the three layouts the tensors under ``prefix`` use."""
    if f"{prefix}.scales" in weights:
        return "nvfp4"
    if f"{prefix}.weight_scale" in weights:
        return "fp8"
    return "dense"


def make_linear(weights: dict, prefix: str, dtype=mx.float32, nvfp4: str | None = None
                ) -> nn.Module:
    """Build the linear layer stored under ``prefix`` from a flat tensor dict.

    ``dtype`` is the compute dtype: activations, dense weights and decoded FP8 weights
    use it. ``nvfp4`` is ``"quantized"`` (codes stay packed) or ``"dequantized"``
    (decoded once at load); None means :data:`NVFP4_POLICY`."""
    bias = weights.get(f"{prefix}.bias")
    if bias is not None:
        bias = bias.astype(dtype)
    fmt = module_format(weights, prefix)
    if fmt == "nvfp4":
        w, s = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
        ws2 = weights[f"{prefix}.weight_scale_2"].astype(mx.float32)
        if (nvfp4 or NVFP4_POLICY) == "dequantized":
            return ScaledLinear(dequantize_nvfp4(w, s, accumulation_dtype(dtype)), ws2, bias)
        return NVFP4Linear(w, s, ws2, bias)
    if fmt == "fp8":
        return FP8Linear(weights[f"{prefix}.weight"], weights[f"{prefix}.weight_scale"]
                         .astype(mx.float32), accumulation_dtype(dtype), bias)
    w = weights[f"{prefix}.weight"].astype(dtype)
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    layer.weight = w
    if bias is not None:
        layer.bias = bias
    return layer


# ---------------------------------------------------------------------------------------
# Stacked routed experts: weight (E, out, ...) with a leading expert axis. Called as
# ``layer(x, idx)`` with ``x (..., 1, 1, in)`` and ``idx (..., k)`` -> ``(..., k, 1, out)``
# (mlx-lm's SwitchLinear convention). ``sorted_indices`` tells MLX that ``idx`` is sorted,
# which makes the gathered matmul contiguous per expert for long inputs.


def expert_compute_dtype(dtype):
    """The dtype the gathered expert matmuls run in. MLX's CPU ``gather_mm`` only accepts
    float32 and its CPU ``gather_qmm`` is several times slower in bf16 than in float32
    (measured, benchmarks/bench_target.py), so on the CPU experts compute in float32 whatever
    the model dtype; their inputs and outputs are cast at the boundary. A float16 model's
    experts compute in float32 everywhere (:func:`accumulation_dtype`)."""
    return accumulation_dtype(dtype) if on_gpu() else mx.float32


class NVFP4Experts(nn.Module):
    """Packed NVFP4 experts: ``mx.gather_qmm`` on the codes, then each expert's own tensor
    scale on its output (``* ws2[idx]``)."""

    def __init__(self, weight, scales, weight_scale_2, compute_dtype=mx.float32):
        super().__init__()
        self.weight = weight
        self.scales = scales
        self.weight_scale_2 = weight_scale_2
        self.compute_dtype = compute_dtype

    def __call__(self, x, idx, sorted_indices=False):
        y = mx.gather_qmm(x.astype(self.compute_dtype), self.weight, self.scales,
                          rhs_indices=idx, transpose=True, group_size=GROUP_SIZE, bits=4,
                          mode="nvfp4", sorted_indices=sorted_indices)
        y = y * self.weight_scale_2[idx].astype(y.dtype)[..., None, None]
        return y.astype(x.dtype)


class DenseExperts(nn.Module):
    """Float experts (BF16/F32 checkpoints, or FP8 decoded at load), held in the model's dtype
    and computed in ``compute_dtype`` (:func:`expert_compute_dtype`: float32 on the CPU, whose
    ``gather_mm`` takes nothing else); ``scale`` is the per-expert FP8 tensor scale, None for
    plain float weights."""

    def __init__(self, weight, scale=None, compute_dtype=None):
        super().__init__()
        self.weight = weight
        if scale is not None:
            self.scale = scale
        self.compute_dtype = compute_dtype or weight.dtype

    def __call__(self, x, idx, sorted_indices=False):
        cdt = self.compute_dtype
        y = mx.gather_mm(x.astype(cdt), self.weight.astype(cdt).swapaxes(-1, -2),
                         rhs_indices=idx, sorted_indices=sorted_indices)
        if "scale" in self:
            y = y * self.scale[idx].astype(y.dtype)[..., None, None]
        return y.astype(x.dtype)


def make_experts(weights: dict, prefix: str, dtype=mx.float32) -> nn.Module:
    """The stacked experts stored under ``prefix``. NVFP4 experts always stay packed: on the
    CPU ``gather_qmm`` in float32 beats ``gather_mm`` over decoded weights
    (docs/history/measurements.md) and reads 8x fewer bytes, and decoding the 128 experts of a real
    MoE layer would take 5 GB in float32. Float experts are held in ``dtype`` (bf16 stays bf16,
    as the dtype asked for) and cast to the compute dtype as they are used."""
    cdt = expert_compute_dtype(dtype)
    fmt = module_format(weights, prefix)
    if fmt == "nvfp4":
        return NVFP4Experts(weights[f"{prefix}.weight"], weights[f"{prefix}.scales"],
                            weights[f"{prefix}.weight_scale_2"].astype(mx.float32), cdt)
    if fmt == "fp8":
        return DenseExperts(fp8_e4m3_to_float(weights[f"{prefix}.weight"], dtype),
                            weights[f"{prefix}.weight_scale"].astype(mx.float32), cdt)
    return DenseExperts(weights[f"{prefix}.weight"].astype(dtype), compute_dtype=cdt)


@dataclass(frozen=True)
class Weights:
    """A checkpoint's tensors and how modules are built from them (the compute dtype and the
    NVFP4 path): what the model constructors take instead of threading all three."""

    tensors: dict
    dtype: mx.Dtype = mx.float32
    nvfp4: str | None = None

    def __getitem__(self, name: str) -> mx.array:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, default=None):
        return self.tensors.get(name, default)

    def cast(self, name: str) -> mx.array:
        """The tensor ``name`` in the compute dtype."""
        return self.tensors[name].astype(self.dtype)

    def linear(self, prefix: str, dtype=None) -> nn.Module:
        """The linear layer under ``prefix`` (:func:`make_linear`), computing in ``dtype``
        when given, else in the compute dtype."""
        return make_linear(self.tensors, prefix, dtype or self.dtype, self.nvfp4)

    def experts(self, prefix: str) -> nn.Module:
        return make_experts(self.tensors, prefix, self.dtype)

    def embedding(self, prefix: str):
        """The embedding table under ``prefix``, as stored (an array; a layout that quantizes
        it returns a module that looks rows up)."""
        return self[f"{prefix}.weight"]
