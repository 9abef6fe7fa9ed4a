"""The drafter's attention pieces against brute force: the sliding-window mask and the softmax
with per-head sinks (kernels/attention.py)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.kernels.attention import sink_attention, window_mask


@pytest.mark.parametrize("window", [None, 1, 3, 8, 100])
def test_window_mask_sees_exactly_the_last_window_keys_up_to_the_query(window):
    q_pos = np.arange(11, 17)
    k_pos = np.arange(4, 17)
    got = np.array(window_mask(mx.array(q_pos), mx.array(k_pos), window))
    for i, q in enumerate(q_pos):
        # the `window` most recent positions ending at q itself (all of <= q when None)
        visible = set(range(q + 1)) if window is None else set(range(q - window + 1, q + 1))
        for j, k in enumerate(k_pos):
            assert got[i, j] == (k in visible), (q, k, window)
    if window is not None:
        assert got.sum(axis=1).max() <= window
    assert got[np.arange(len(q_pos)), q_pos - k_pos[0]].all()  # every query sees itself


def brute_sink_attention(q, k, v, mask, sinks, scale):
    """float64, one (head, query) at a time: softmax over visible keys plus exp(sink)."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((B, H, T, D))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                vis = np.flatnonzero(mask[t])
                s = scale * k[b, h // group, vis].astype(np.float64) @ q[b, h, t]
                logits = np.concatenate([s, [sinks[h]]]) if sinks is not None else s
                p = np.exp(logits - logits.max())
                p = p / p.sum()
                out[b, h, t] = p[:len(vis)] @ v[b, h // group, vis]
    return out


def _case(seed, sink_values):
    rng = np.random.default_rng(seed)
    H, KV, T, L, D = 8, 2, 4, 9, 16
    q = rng.standard_normal((1, H, T, D)) * 1.5
    k = rng.standard_normal((1, KV, L + T, D)) * 1.5
    v = rng.standard_normal((1, KV, L + T, D))
    q_pos, k_pos = np.arange(L, L + T), np.arange(L + T)
    mask = np.array(window_mask(mx.array(q_pos), mx.array(k_pos), 5))
    return q, k, v, mask, np.array(sink_values, dtype=np.float64)


@pytest.mark.parametrize("sinks", [
    [-20, -8, -3, 0, 0.5, 3, 8, 20],     # far from zero both ways, per head
    [12.0] * 8,                          # sink dominating every head
])
def test_sink_attention_matches_float64_brute_force(sinks):
    q, k, v, mask, s = _case(0, sinks)
    want = brute_sink_attention(q, k, v, mask, s, 0.25)
    f32 = lambda a: mx.array(a.astype(np.float32))
    got = sink_attention(f32(q), f32(k), f32(v), scale=0.25, mask=mx.array(mask), sinks=f32(s))
    err = np.abs(np.array(got) - want).max()
    assert err < 2e-6, err  # measured 4.0e-7 in fp32
    # the sinks really act: without them the result is far from the reference
    no_sink = sink_attention(f32(q), f32(k), f32(v), scale=0.25, mask=mx.array(mask), sinks=None)
    assert np.abs(np.array(no_sink) - want).max() > 1e-2


def test_sink_attention_without_sinks_is_plain_windowed_softmax():
    q, k, v, mask, _ = _case(1, [0] * 8)
    want = brute_sink_attention(q, k, v, mask, None, 0.25)
    f32 = lambda a: mx.array(a.astype(np.float32))
    got = sink_attention(f32(q), f32(k), f32(v), scale=0.25, mask=mx.array(mask), sinks=None)
    assert np.abs(np.array(got) - want).max() < 2e-6


def test_sink_attention_in_bfloat16_stays_close():
    q, k, v, mask, s = _case(2, [-6, -2, 0, 1, 2, 4, 6, 9])
    want = brute_sink_attention(q, k, v, mask, s, 0.25)
    b16 = lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)
    got = sink_attention(b16(q), b16(k), b16(v), scale=0.25, mask=mx.array(mask), sinks=b16(s))
    assert got.dtype == mx.bfloat16
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() < 5e-2  # bf16 inputs: ~1e-2
