"""Quantized layers over the converted layout against an independent float64 NumPy decode
of the same bytes (E2M1 codes, E4M3 block scales, verbatim tensor scales)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.models.quant import (DenseExperts, NVFP4Experts, NVFP4Linear, ScaledLinear,
                                     dequantize_nvfp4, make_experts, make_linear)

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e4m3(b):
    """OCP E4M3 (bias 7, no infinities, 0x7F/0xFF NaN), decoded from its bits."""
    b = np.asarray(b, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7.0))
    return sign * val


def random_nvfp4(rng, shape_out, n_in):
    """Random ModelOpt-style bytes: packed codes (low nibble first), finite positive E4M3
    block scales in a realistic range, and float32 tensor scales."""
    codes = rng.integers(0, 16, size=(*shape_out, n_in), dtype=np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = rng.integers(0x20, 0x60, size=(*shape_out, n_in // 16), dtype=np.uint8)
    lead = shape_out[:-1]
    ws2 = rng.uniform(1e-3, 1e-2, size=lead).astype(np.float32)
    ref = E2M1[codes] * np.repeat(e4m3(scales), 16, axis=-1)
    ref = ref * ws2.astype(np.float64).reshape(*lead, *([1] * 2))
    return (mx.array(packed.view(np.uint32)), mx.array(scales), mx.array(ws2), ref)


@pytest.mark.parametrize("policy", ["quantized", "dequantized"])
def test_nvfp4_linear_applies_block_and_tensor_scales(policy):
    rng = np.random.default_rng(0)
    w, s, ws2, ref = random_nvfp4(rng, (48,), 64)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    layer = make_linear({"p.weight": w, "p.scales": s, "p.weight_scale_2": ws2}, "p",
                        mx.float32, policy)
    assert isinstance(layer, NVFP4Linear if policy == "quantized" else ScaledLinear)
    y = np.array(layer(mx.array(x)))
    expect = x.astype(np.float64) @ ref.T
    assert np.abs(y - expect).max() <= 1e-5 * np.abs(expect).max()


def test_fp8_linear_decodes_every_byte_exactly():
    rng = np.random.default_rng(1)
    raw = np.arange(256, dtype=np.uint8)
    raw = raw[(raw & 0x7F) != 0x7F].reshape(2, -1)          # every finite E4M3 byte
    scale = np.float32(0.0123)
    layer = make_linear({"p.weight": mx.array(raw), "p.weight_scale": mx.array(scale)}, "p",
                        mx.float32)
    np.testing.assert_array_equal(np.array(layer.weight), e4m3(raw).astype(np.float32))
    x = rng.standard_normal((3, raw.shape[1])).astype(np.float32)
    expect = x.astype(np.float64) @ (e4m3(raw) * np.float64(scale)).T
    assert np.abs(np.array(layer(mx.array(x))) - expect).max() <= 1e-5 * np.abs(expect).max()


def test_nvfp4_decode_without_tensor_scale_is_exact_in_bf16():
    # e2m1 (2 significant bits) x e4m3 (4 bits) fits bf16's 8: the CPU policy loses nothing
    rng = np.random.default_rng(4)
    w, s, _, _ = random_nvfp4(rng, (8,), 64)
    s = mx.array(np.arange(256, dtype=np.uint8)[(np.arange(256) & 0x7F) != 0x7F][:32]
                 .reshape(8, 4))                              # also subnormal scales
    f32 = dequantize_nvfp4(w, s, mx.float32)
    assert mx.array_equal(dequantize_nvfp4(w, s, mx.bfloat16).astype(mx.float32), f32)


def _expert_reference(x, ref, idx):
    return np.stack([[ref[e] @ x[t] for e in row] for t, row in enumerate(idx)])


@pytest.mark.parametrize("sort", [False, True])
def test_nvfp4_experts_use_each_experts_own_tensor_scale(sort):
    rng = np.random.default_rng(2)
    w, s, ws2, ref = random_nvfp4(rng, (6, 40), 32)
    layer = make_experts({"e.weight": w, "e.scales": s, "e.weight_scale_2": ws2}, "e",
                         mx.float32)
    assert isinstance(layer, NVFP4Experts)
    x = rng.standard_normal((7, 32)).astype(np.float32)
    idx = np.stack([rng.choice(6, 2, replace=False) for _ in range(7)])
    expect = _expert_reference(x.astype(np.float64), ref, idx)
    if sort:        # the MoE's long-input layout: one (token, expert) pair per row, sorted
        flat = idx.flatten()
        order = np.argsort(flat, kind="stable")
        y = layer(mx.array(x[order // 2])[:, None, None], mx.array(flat[order])[:, None], True)
        got = np.empty((14, 40))
        got[order] = np.array(y)[:, 0, 0]
        got = got.reshape(7, 2, 40)
    else:
        got = np.array(layer(mx.array(x)[:, None, None], mx.array(idx)))[:, :, 0]
    assert np.abs(got - expect).max() <= 1e-5 * np.abs(expect).max()


def test_fp8_experts_scale_each_expert():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 0x70, size=(3, 8, 16), dtype=np.uint8)     # finite E4M3 bytes
    scale = np.array([0.5, 0.01, 3.0], dtype=np.float32)
    layer = make_experts({"e.weight": mx.array(raw), "e.weight_scale": mx.array(scale)}, "e",
                         mx.float32)
    assert isinstance(layer, DenseExperts)
    x = rng.standard_normal((4, 16))
    idx = np.array([[0, 1], [2, 0], [1, 2], [2, 2]])
    got = np.array(layer(mx.array(x.astype(np.float32))[:, None, None], mx.array(idx)))[:, :, 0]
    expect = _expert_reference(x, e4m3(raw) * scale[:, None, None].astype(np.float64), idx)
    assert np.abs(got - expect).max() <= 1e-5 * np.abs(expect).max()


def test_dense_experts_from_float_weights():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((4, 24, 16))
    layer = make_experts({"e.weight": mx.array(ref.astype(np.float32))}, "e", mx.float32)
    x = rng.standard_normal((3, 16))
    idx = np.array([[0, 3], [2, 1], [3, 3]])
    got = np.array(layer(mx.array(x.astype(np.float32))[:, None, None], mx.array(idx)))[:, :, 0]
    expect = _expert_reference(x, ref, idx)
    assert np.abs(got - expect).max() <= 1e-5 * np.abs(expect).max()
