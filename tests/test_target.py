"""The Nemotron-H target against mlx-lm's independent implementation on identical random
weights (fp32), incremental decoding, taps, and verify/commit with exact rollback."""

import json

import mlx.core as mx
import pytest
from testkit.target_helpers import mlx_lm_from_hf_weights, quantize_like_modelopt, twin_models

from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config

from mlx_dspark.models.nemotron_h import SERIAL_MAX, KVCache, MambaCache, TargetConfig, load_target


@pytest.fixture(scope="module")
def twins():
    return twin_models(tiny_config())


def _tokens(n, seed=1, vocab=97):
    return mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))


def _rel(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize("length", [1, 5, SERIAL_MAX, 40])   # serial and chunked SSM paths
def test_logits_match_mlx_lm_in_fp32(twins, length):
    ours, ref = twins
    toks = _tokens(length)
    a, b = ours(toks), ref(toks)
    assert a.shape == (1, length, 97)
    assert _rel(a, b) < 2e-6
    assert (a.argmax(-1) == b.argmax(-1)).all().item()


def test_group_routing_matches_mlx_lm_when_selection_is_unambiguous():
    # n_group > 1: mlx-lm zeroes dropped groups where transformers uses -inf; the two agree
    # when every correction-biased score is positive, which a positive bias guarantees.
    cfg = tiny_config("EE", n_group=2, topk_group=1)
    ref = random_mlx_lm_model(cfg, seed=3)
    w = hf_weights_from_mlx_lm(ref, stacked=True)
    for k in [k for k in w if k.endswith("e_score_correction_bias")]:
        w[k] = mx.abs(w[k]) + 0.1
    ref.load_weights([(k, v) for k, v in w.items() if k.endswith("e_score_correction_bias")],
                     strict=False)
    from mlx_dspark.models.nemotron_h import NemotronH
    ours = NemotronH(TargetConfig.from_dict(cfg), w, mx.float32)
    toks = _tokens(24)
    assert _rel(ours(toks), ref(toks)) < 2e-6


def _save_hf_dir(tmp_path, cfg, weights, dtype=mx.float32):
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {k: v.astype(dtype) for k, v in weights.items()})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("spelling", ["hybrid_override_pattern", "layers_block_type"])
def test_load_target_reads_an_hf_format_directory(tmp_path, spelling):
    cfg = tiny_config()
    ref = random_mlx_lm_model(cfg)
    disk_cfg = dict(cfg)
    if spelling == "layers_block_type":
        names = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
        disk_cfg["layers_block_type"] = [names[c] for c in disk_cfg.pop("hybrid_override_pattern")]
    disk_cfg["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    # per-expert tensors and conv1d (C, 1, K), as save_pretrained writes them
    path = _save_hf_dir(tmp_path, disk_cfg, hf_weights_from_mlx_lm(ref, stacked=False))
    ours = load_target(path, dtype=mx.float32)
    assert ours.config.hybrid_override_pattern == "M*EM-E"
    assert ours.config.num_hidden_layers == 6
    toks = _tokens(20)
    assert _rel(ours(toks), ref(toks)) < 2e-6


@pytest.mark.parametrize("policy", ["quantized", "dequantized"])
def test_converted_nvfp4_and_fp8_checkpoint_matches_mlx_lm_on_dequantized_weights(
        tmp_path, policy):
    """Every projection NVFP4 (experts stacked, per-expert tensor scales) except the
    Mamba out_proj in FP8, as the converter lays them out; mlx-lm runs the exact float
    weights those bytes stand for."""
    cfg = tiny_config()
    conv, deq = quantize_like_modelopt(hf_weights_from_mlx_lm(random_mlx_lm_model(cfg),
                                                              stacked=True))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), conv)
    modules = {k.rsplit(".", 1)[0]: "nvfp4" for k in conv if k.endswith(".scales")}
    modules.update({k.rsplit(".", 1)[0]: "fp8" for k in conv if k.endswith(".weight_scale")})
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization={
        "layout": "mlx-dspark/1", "group_size": 16, "source_quant_algo": "MIXED_PRECISION",
        "modules": modules})))
    ours = load_target(str(tmp_path), dtype=mx.float32, nvfp4=policy, verify="none")
    ref = mlx_lm_from_hf_weights(cfg, deq)
    toks = _tokens(30)
    a, b = ours(toks), ref(toks)
    assert _rel(a, b) < 5e-6
    assert (a.argmax(-1) == b.argmax(-1)).all().item()


@pytest.mark.slow
def test_bf16_compute_stays_close_to_fp32(twins):
    ours32, ref = twins
    from mlx_dspark.models.nemotron_h import NemotronH, default_dtype
    assert default_dtype() == (mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
    ours16 = NemotronH(TargetConfig.from_dict(tiny_config()),
                       hf_weights_from_mlx_lm(ref, stacked=True), mx.bfloat16)
    toks = _tokens(20)
    a = ours16(toks)
    assert a.dtype == mx.bfloat16
    assert _rel(a.astype(mx.float32), ours32(toks)) < 5e-2


def test_load_target_names_the_missing_tensor(tmp_path):
    cfg = tiny_config()
    w = hf_weights_from_mlx_lm(random_mlx_lm_model(cfg))
    del w["backbone.layers.0.mixer.dt_bias"]
    with pytest.raises(ValueError, match="backbone.layers.0.mixer.dt_bias"):
        load_target(_save_hf_dir(tmp_path, cfg, w))


def test_config_without_a_layer_pattern_is_refused():
    cfg = tiny_config()
    del cfg["hybrid_override_pattern"]
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        TargetConfig.from_dict(cfg)


def test_incremental_decoding_equals_full_forward(twins):
    ours, _ = twins
    toks = _tokens(48)
    full = ours(toks)
    cache = ours.make_cache()
    parts = [ours.step(toks[:, :30], cache)[0]]          # chunked prefill
    parts += [ours.step(toks[:, i:i + 1], cache)[0] for i in range(30, 40)]
    parts.append(ours.step(toks[:, 40:], cache)[0])      # an 8-token serial block
    inc = mx.concatenate(parts, axis=1)
    # chunked vs serial SSM differ only by float32 rounding (measured ~4e-6 absolute)
    assert _rel(inc, full) < 5e-6
    assert (inc.argmax(-1) == full.argmax(-1)).all().item()
    assert cache.offset == 48


def test_long_steps_are_fed_in_pieces_with_the_same_result(twins, monkeypatch):
    import mlx_dspark.models.nemotron_h as target
    ours, _ = twins
    toks = _tokens(70)
    whole, whole_taps = ours.step(toks, ours.make_cache(), tap_layers=(0, 4))
    monkeypatch.setattr(target, "PREFILL_STEP", 32)       # 2 chunks of 16 per piece
    cache = ours.make_cache()
    split, split_taps = ours.step(toks, cache, tap_layers=(0, 4))
    assert cache.offset == 70 and split.shape == whole.shape
    assert split_taps.shape == whole_taps.shape == (70, 128)
    assert _rel(split, whole) < 1e-6 and _rel(split_taps, whole_taps) < 1e-6


def test_taps_are_the_pre_norm_residual_stream_of_the_chosen_layers(twins):
    ours, ref = twins
    toks = _tokens(12)
    cache = ours.make_cache()
    _, taps = ours.step(toks, cache, tap_layers=(1, 5))
    # mlx-lm's layers on the same weights give the residual stream after each block
    h = ref.backbone.embeddings(toks)
    streams = []
    for layer, c in zip(ref.backbone.layers, [None] * 6):
        mask = "causal" if layer.block_type == "*" else None
        h = layer(h, mask=mask, cache=c)
        streams.append(h[0])
    assert taps.shape == (12, 2 * 64)
    assert mx.abs(taps[:, :64] - streams[1]).max().item() < 1e-5
    assert mx.abs(taps[:, 64:] - streams[5]).max().item() < 1e-5


def _state(cache):
    out = []
    for c in cache.layers:
        if isinstance(c, KVCache):
            out += list(c.state())
        elif isinstance(c, MambaCache):
            out += [c.conv, c.ssm]
    return out


def test_verify_logits_and_taps_equal_a_plain_step(twins):
    ours, _ = twins
    toks = _tokens(20)
    a, b = ours.make_cache(), ours.make_cache()
    ours.step(toks[:, :15], a)
    ours.step(toks[:, :15], b)
    la, ta = ours.step(toks[:, 15:], a, tap_layers=(0, 3))
    lb, tb = ours.verify(toks[:, 15:], b, tap_layers=(0, 3))
    assert mx.array_equal(la, lb) and mx.array_equal(ta, tb)


def _worst_rollback_difference(model, toks, context):
    worst = 0.0
    for n in range(1, 8):
        for a in range(n + 1):
            cache = model.make_cache()
            model.step(toks[:, :context], cache)
            model.verify(toks[:, context:context + n + 1], cache)
            model.commit(cache, a + 1)
            fresh = model.make_cache()
            model.step(toks[:, :context], fresh)
            model.step(toks[:, context:context + a + 1], fresh)
            assert cache.offset == fresh.offset == context + a + 1
            nxt = toks[:, context + 8:context + 9]
            pairs = list(zip(_state(cache), _state(fresh)))
            pairs.append((model.step(nxt, cache)[0], model.step(nxt, fresh)[0]))
            worst = max(worst, *(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))
                                 .max().item() for x, y in pairs))
    return worst


@pytest.mark.parametrize("context", [1, 6, 29])
def test_commit_leaves_exactly_the_state_of_the_accepted_prefix(twins, context):
    """a in 0..N accepted drafts, N in 1..7: KV, conv and SSM state, and the next step's
    logits, equal a fresh run over context + [bonus, d1..da] to the bit (fp32)."""
    ours, _ = twins
    assert _worst_rollback_difference(ours, _tokens(context + 9, seed=context), context) == 0.0


@pytest.mark.slow
def test_commit_is_exact_in_bf16_too(twins):
    from mlx_dspark.models.nemotron_h import NemotronH
    _, ref = twins
    ours16 = NemotronH(TargetConfig.from_dict(tiny_config()),
                       hf_weights_from_mlx_lm(ref, stacked=True), mx.bfloat16)
    assert _worst_rollback_difference(ours16, _tokens(29, seed=7), 20) == 0.0


def test_rejected_drafts_do_not_leak_into_the_next_round(twins):
    ours, _ = twins
    toks = _tokens(30)
    cache = ours.make_cache()
    ours.step(toks[:, :10], cache)
    ours.verify(toks[:, 10:14], cache)
    ours.commit(cache, 2)                                   # keep 10, 11
    l1, _ = ours.verify(toks[:, 12:16], cache)              # a different continuation
    ours.commit(cache, 4)
    fresh = ours.make_cache()
    ours.step(toks[:, :10], fresh)
    ours.step(toks[:, 10:12], fresh)
    l2, _ = ours.step(toks[:, 12:16], fresh)
    assert mx.array_equal(l1, l2)
    assert all(mx.array_equal(x, y) for x, y in zip(_state(cache), _state(fresh)))


def test_commit_rejects_misuse(twins):
    ours, _ = twins
    cache = ours.make_cache()
    with pytest.raises(RuntimeError):
        ours.commit(cache, 1)
    ours.verify(_tokens(3), cache)
    with pytest.raises(ValueError):
        ours.commit(cache, 4)
    with pytest.raises(RuntimeError):
        ours.step(_tokens(1), cache)


def test_bad_tap_layers_are_refused_before_the_cache_moves(twins):
    ours, _ = twins
    cache = ours.make_cache()
    with pytest.raises(ValueError, match="tap layers"):
        ours.step(_tokens(3), cache, tap_layers=(1, 6))
    assert cache.offset == 0 and all(c is None or c.keys is None if isinstance(c, KVCache)
                                     else c is None or c.ssm is None for c in cache.layers)


def test_a_corrupt_safetensors_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_target(str(tmp_path))


@pytest.mark.parametrize("device,dtype", [(mx.gpu, mx.bfloat16), (mx.cpu, mx.float32)])
def test_dtype_choices_follow_the_default_device_not_metal(monkeypatch, device, dtype):
    # Forced through mx.default_device (MLX refuses set_default_device(gpu) without a GPU
    # backend): any GPU backend gets bf16 compute and bf16 expert matmuls, the CPU its
    # measured float32 choices.
    from mlx_dspark.models.quant import expert_compute_dtype
    from mlx_dspark.models.nemotron_h import default_dtype
    monkeypatch.setattr(mx.metal, "is_available", lambda: device == mx.cpu)   # must not matter
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device, 0))
    assert default_dtype() == dtype
    assert expert_compute_dtype(mx.bfloat16) == dtype
