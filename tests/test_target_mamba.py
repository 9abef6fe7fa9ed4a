"""kernels/mamba.py against an independent float64 NumPy Mamba-2 recurrence."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.kernels import mamba as K


def numpy_ssm(state, x, dt, A, B, C, D):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T ;  y_t = h_t C_t + D x_t  (per head; the
    heads of group g read B[:, g], C[:, g])."""
    b, t, h, p = x.shape
    g = B.shape[2]
    ys = np.zeros_like(x)
    state = state.copy()
    for i in range(t):
        for hh in range(h):
            gg = hh // (h // g)
            decay = np.exp(dt[:, i, hh] * A[hh])[:, None, None]
            upd = (dt[:, i, hh, None] * x[:, i, hh])[:, :, None] * B[:, i, gg][:, None, :]
            state[:, hh] = decay * state[:, hh] + upd
            ys[:, i, hh] = np.einsum("bpn,bn->bp", state[:, hh], C[:, i, gg]) \
                + D[hh] * x[:, i, hh]
    return ys, state


def _inputs(t, seed=0, b=1, h=6, p=4, g=2, n=5):
    r = np.random.default_rng(seed)
    return dict(
        state=r.standard_normal((b, h, p, n)), x=r.standard_normal((b, t, h, p)),
        dt=np.log1p(np.exp(r.standard_normal((b, t, h)) - 1.0)),
        A=-r.uniform(0.5, 8.0, h), B=r.standard_normal((b, t, g, n)),
        C=r.standard_normal((b, t, g, n)), D=r.standard_normal(h))


def _mx(d):
    return {k: mx.array(v.astype(np.float32)) for k, v in d.items()}


@pytest.mark.parametrize("form", ["serial", "chunked"])
@pytest.mark.parametrize("t", [1, 7, 37])            # 37 = 4 chunks of 10, the last ragged
def test_ssm_matches_float64_recurrence(form, t):
    d = _inputs(t, seed=t)
    want_y, want_s = numpy_ssm(**d)
    m = _mx(d)
    if form == "serial":
        y, s = K.ssm_serial(m["state"], m["x"], m["dt"], m["A"], m["B"], m["C"], m["D"])
    else:
        y, s = K.ssm_chunked(m["state"], m["x"], m["dt"], m["A"], m["B"], m["C"], m["D"],
                             chunk=10)
    assert np.abs(np.array(y) - want_y).max() <= 1e-5 * np.abs(want_y).max()
    assert np.abs(np.array(s) - want_s).max() <= 1e-5 * np.abs(want_s).max()


def test_replay_reaches_the_serial_state_bit_for_bit():
    m = _mx(_inputs(6, seed=3))
    _, s = K.ssm_serial(m["state"], m["x"][:, :4], m["dt"][:, :4], m["A"], m["B"][:, :4],
                        m["C"][:, :4], m["D"])
    r = K.ssm_replay(m["state"], m["x"][:, :4], m["dt"][:, :4], m["A"], m["B"][:, :4],
                     m["C"][:, :4])
    assert mx.array_equal(s, r)


def test_causal_conv_matches_numpy_and_is_position_local():
    r = np.random.default_rng(1)
    padded = r.standard_normal((1, 3 + 9, 5)).astype(np.float32)
    w = r.standard_normal((5, 4)).astype(np.float32)
    bias = r.standard_normal(5).astype(np.float32)
    want = np.stack([(padded[0, i:i + 4].T * w).sum(-1) + bias for i in range(9)])[None]
    got = K.causal_conv(mx.array(padded), mx.array(w), mx.array(bias))
    assert np.abs(np.array(got) - want).max() < 1e-5
    # a position's output does not depend on how many positions are computed with it
    part = K.causal_conv(mx.array(padded[:, :3 + 4]), mx.array(w), mx.array(bias))
    assert mx.array_equal(part, got[:, :4])


def test_dt_is_clipped_only_by_time_step_limit():
    raw = mx.array([[-20.0, 0.0, 30.0]])
    bias = mx.zeros(3)
    free = K.discretize_dt(raw, bias, (0.0, float("inf")))
    assert free[0, 0].item() < 1e-3                      # no time_step_min clamp
    clipped = K.discretize_dt(raw, bias, (1e-3, 10.0))
    assert np.allclose(np.array(clipped), [[1e-3, np.log(2.0), 10.0]])
