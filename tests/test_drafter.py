"""The drafter against the float64 reference (tests/reference_drafter.py) on the committed tiny
checkpoint (tests/fixtures/drafter/): greedy and sampled proposals, the Markov-corrected
logits, contexts shorter and longer than the sliding window (5 keys), sinks far from zero,
embedding sharing, and O(window) memory."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from fixtures.drafter import tiny
from testkit.reference_drafter import ReferenceDrafter, read_safetensors

from mlx_dspark.drafters import load_drafter
from mlx_dspark.logits.sampling import warp

# Measured max |z - z_ref| / max |z_ref| over N = 1..7 and contexts 0..20 tokens:
# fp32 8.1e-7 (packed NVFP4 matmul) and 7.0e-7 (NVFP4 decoded at load); bf16 2.3e-2.
FP32_TOL = 1e-5
BF16_TOL = 6e-2
TAPS = np.random.default_rng(0).standard_normal((24, tiny.HIDDEN * len(tiny.TAPS)))


@pytest.fixture(scope="module")
def ref():
    t = read_safetensors(tiny.TARGET)
    return ReferenceDrafter(tiny.DRAFTER, t["embed.weight"], t["lm_head.weight"])


@pytest.fixture(scope="module", params=["quantized", "dequantized"])
def drafter(request):
    return load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), dtype=mx.float32, nvfp4=request.param)


def feed(d, P, chunks=(3, 1, 1, 4, 2)):
    """Commit TAPS[:P] in uneven chunks, as prefill and rounds would."""
    d.reset()
    pos, i = 0, 0
    while pos < P:
        t = min(chunks[i % len(chunks)], P - pos)
        d.add_context(mx.array(TAPS[pos:pos + t].astype(np.float32)), pos)
        pos, i = pos + t, i + 1


def rel_err(z, ref_z):
    return float(np.abs(np.array(z) - ref_z).max() / np.abs(ref_z).max())


@pytest.mark.parametrize("P", [0, 3, 4, 13, 24])  # window 5: below, at, and well past it
def test_greedy_proposals_and_markov_logits_match_float64_reference(drafter, ref, P):
    feed(drafter, P)
    for n in range(1, 8):
        bonus = (17 * n + P) % tiny.VOCAB
        tokens, z = drafter.propose(bonus, n)
        want_tokens, want_z = ref.propose(TAPS[:P], bonus, n)
        assert tokens.shape == (n,) and z.shape == (n, tiny.VOCAB) and z.dtype == mx.float32
        assert np.array(tokens).tolist() == want_tokens.tolist(), (P, n)
        assert rel_err(z, want_z) < FP32_TOL, (P, n)


def test_a_catch_up_longer_than_the_window_computes_only_the_window(drafter, ref):
    # A long prompt or serial stretch reaches the drafter in one add_context: only the
    # tokens still inside the window go through fc and the K/V projections, and the
    # proposals are the float64 reference's over the whole context.
    rows = []
    fc = drafter.fc
    drafter.fc = lambda x: rows.append(x.shape[0]) or fc(x)
    try:
        drafter.reset()
        drafter.add_context(mx.array(TAPS.astype(np.float32)), 0)
    finally:
        drafter.fc = fc
    assert rows == [tiny.WINDOW - 1] and drafter.length == len(TAPS)
    for n in (1, 4, 7):
        tokens, z = drafter.propose(99, n)
        want_tokens, want_z = ref.propose(TAPS, 99, n)
        assert np.array(tokens).tolist() == want_tokens.tolist()
        assert rel_err(z, want_z) < FP32_TOL


def test_shorter_block_is_the_longer_block_truncated(drafter):
    """The block is causal, so drafting N tokens is the first N rows of drafting 7."""
    feed(drafter, 13)
    t7, z7 = drafter.propose(42, 7)
    for n in (1, 3, 6):
        t, z = drafter.propose(42, n)
        assert np.array_equal(np.array(t), np.array(t7[:n]))
        assert np.abs(np.array(z) - np.array(z7[:n])).max() < 1e-5


def test_sampled_tokens_come_from_the_returned_logits(drafter, ref):
    feed(drafter, 9)
    seen = set()
    for seed in range(4):
        noise = mx.random.gumbel((5, tiny.VOCAB), key=mx.random.key(seed))
        tokens, z = drafter.propose(3, 5, temperature=0.9, top_p=0.95, top_k=40, noise=noise)
        # each z_j is the Markov correction for the token actually drawn before it
        _, want_z = ref.propose(TAPS[:9], 3, 5, tokens=np.array(tokens))
        assert rel_err(z, want_z) < FP32_TOL
        probs = np.array(warp(z, 0.9, 0.95, 40))
        assert (probs[np.arange(5), np.array(tokens)] > 0).all()
        again, _ = drafter.propose(3, 5, temperature=0.9, top_p=0.95, top_k=40, noise=noise)
        assert np.array_equal(np.array(again), np.array(tokens))  # same noise, same draw
        seen.add(tuple(np.array(tokens).tolist()))
    assert len(seen) > 1


def test_first_draft_frequencies_follow_the_returned_distribution(drafter):
    """600 sampled proposals: d_1's histogram against warp(z_1) (chi-square, fixed noise)."""
    feed(drafter, 7)
    probs, counts = None, np.zeros(tiny.VOCAB)
    for seed in range(600):
        noise = mx.random.gumbel((1, tiny.VOCAB), key=mx.random.key(seed))
        tokens, z = drafter.propose(9, 1, temperature=1.5, top_k=12, noise=noise)
        counts[int(tokens[0])] += 1
        p = np.array(warp(z, 1.5, 1.0, 12))[0]
        assert probs is None or np.array_equal(p, probs)  # z_1 does not depend on the draw
        probs = p
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = 600 * probs[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 31.3, chi2  # 99.9% quantile of chi-square with 11 degrees of freedom


def test_sinks_far_from_zero_are_applied():
    """Zeroing the fixture's sinks (-9.5 to 9 per head) must move the logits."""
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), dtype=mx.float32)
    feed(d, 8)
    _, z = d.propose(5, 3)
    for layer in d.layers:
        layer.self_attn.attention_sink_bias = mx.zeros_like(layer.self_attn.attention_sink_bias)
    _, z0 = d.propose(5, 3)
    assert np.abs(np.array(z) - np.array(z0)).max() > 1e-2


def test_bfloat16_drafter_stays_close_to_reference(ref):
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(dtype=mx.bfloat16), dtype=mx.bfloat16)
    feed(d, 13)
    _, z = d.propose(11, 7)
    _, want_z = ref.propose(TAPS[:13], 11, 7)
    assert rel_err(z, want_z) < BF16_TOL


def test_embedding_is_borrowed_from_the_target_when_bit_identical():
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), dtype=mx.float32)
    assert "embed_tokens" not in d  # the fixture's embed_tokens is a copy of the target's
    assert d.gate_report == "46/46 tensors match"


def test_own_embedding_is_kept_and_used_when_it_differs(tmp_path, ref):
    path = tmp_path / "drafter"
    shutil.copytree(tiny.DRAFTER, path)
    w = mx.load(str(path / "model.safetensors"))
    e = w["embed_tokens.weight"]
    w["embed_tokens.weight"] = mx.concatenate([e[:tiny.MASK_ID], -e[tiny.MASK_ID:]])
    mx.save_safetensors(str(path / "model.safetensors"), w)
    tiny.write_receipt(str(path))
    d = load_drafter(str(path), tiny.ArrayTarget(), dtype=mx.float32)
    assert "embed_tokens" in d
    assert d.gate_report == "46/46 tensors match"
    t = read_safetensors(tiny.TARGET)
    own = ReferenceDrafter(str(path), t["embed.weight"], t["lm_head.weight"])
    feed(d, 6)
    tokens, z = d.propose(200, 4)
    want_tokens, want_z = own.propose(TAPS[:6], 200, 4)
    assert np.array(tokens).tolist() == want_tokens.tolist()
    assert rel_err(z, want_z) < FP32_TOL
    # and it is not what the target's embedding would give
    assert np.abs(want_z - ref.propose(TAPS[:6], 200, 4)[1]).max() > 1e-2


def test_context_memory_stays_flat_past_the_window():
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), dtype=mx.float32)
    cache = d.make_cache()                  # a session's cache, as the decode loop passes it
    sizes, active = [], []
    taps = mx.array(np.tile(TAPS.astype(np.float32), (10, 1)))  # 240 tokens
    for p in range(taps.shape[0]):
        d.add_context(taps[p:p + 1], p, cache)
        tokens, z = d.propose(1, 3, cache=cache)
        mx.eval(tokens, z)
        sizes.append(cache.nbytes)
        active.append(mx.get_active_memory())
    per_token = cache.nbytes // (tiny.WINDOW - 1)
    assert sizes[tiny.WINDOW - 2] == sizes[-1] == per_token * (tiny.WINDOW - 1)
    assert sizes[1] == 2 * per_token  # below the window, it grows with the context
    assert max(active[50:]) - min(active[50:]) < 64 * 1024  # no growth over 190 more tokens


def test_contexts_must_be_contiguous_and_blocks_fit_block_size():
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), dtype=mx.float32)
    d.add_context(mx.array(TAPS[:4].astype(np.float32)), 0)
    with pytest.raises(ValueError, match="contiguous"):
        d.add_context(mx.array(TAPS[5:6].astype(np.float32)), 5)
    with pytest.raises(ValueError, match=r"taps must be \[T, 192\]"):
        d.add_context(mx.array(TAPS[4:5, :64].astype(np.float32)), 4)
    for n in (0, tiny.BLOCK):
        with pytest.raises(ValueError, match="1..7"):
            d.propose(1, n)
    assert d.target_layer_ids == tiny.TAPS
    # each cache checks its own contiguity: a fresh one starts at 0 whatever the own one holds
    other = d.make_cache()
    d.add_context(mx.array(TAPS[:2].astype(np.float32)), 0, other)
    assert other.length == 2 and d.length == 4
    d.reset()
    assert d.length == 0 and d._cache(None).nbytes == 0
