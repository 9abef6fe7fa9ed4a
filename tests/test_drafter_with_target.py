"""The drafter fed by a real (tiny) Nemotron-H target from mlx_dspark.models.nemotron_h: taps from
``step``/``verify``, the target's embedding and lm_head borrowed, rounds committed as the loop
does; every proposal checked against the float64 reference."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures.drafter import tiny
from testkit.reference_drafter import ReferenceDrafter, read_safetensors
from testkit.target_helpers import quantize_like_modelopt

from mlx_dspark.drafters import load_drafter
from mlx_dspark.drafters.config import DrafterError
from mlx_dspark.models.nemotron_h import NemotronH, TargetConfig
from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config

FP32_TOL = 1e-5  # as in test_drafter.py


def nemotron_target(layers="M*EM", vocab=tiny.VOCAB, nvfp4=None):
    """A 4-layer Nemotron-H whose embedding and lm_head are the drafter fixture's target;
    its Mamba and MoE projections NVFP4/FP8 in the converted layout."""
    cfg = tiny_config(pattern=layers, vocab_size=vocab, hidden_size=tiny.HIDDEN)
    w, _ = quantize_like_modelopt(hf_weights_from_mlx_lm(random_mlx_lm_model(cfg, seed=3),
                                                         stacked=True))
    if vocab == tiny.VOCAB:
        t = mx.load(tiny.TARGET)
        w["backbone.embeddings.weight"], w["lm_head.weight"] = t["embed.weight"], t["lm_head.weight"]
    model = NemotronH(TargetConfig.from_dict(cfg), w, mx.float32, nvfp4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("nvfp4", ["quantized", "dequantized"])
def test_rounds_with_real_target_taps_match_reference(nvfp4):
    target = nemotron_target(nvfp4=nvfp4)
    d = load_drafter(tiny.DRAFTER, target, nvfp4=nvfp4)
    assert d.gate_report == "46/46 tensors match"  # the target's own layers are not ours
    assert "embed_tokens" not in d  # the target's embedding is the drafter's, bit for bit
    t = read_safetensors(tiny.TARGET)
    ref = ReferenceDrafter(tiny.DRAFTER, t["embed.weight"], t["lm_head.weight"])

    cache, context = target.make_cache(), d.make_cache()   # as a session holds them
    prompt = mx.array([[3, 17, 99, 4, 250, 8, 8, 61, 130]])
    logits, taps = target.step(prompt, cache, tap_layers=d.target_layer_ids)
    assert taps.shape == (9, tiny.HIDDEN * len(tiny.TAPS))
    d.add_context(taps, 0, context)
    history = [np.array(taps, dtype=np.float64)]
    bonus = int(mx.argmax(logits[0, -1]))
    for accepted in (2, 0, 3, 1):  # a few rounds, each keeping a different prefix
        drafts, z = d.propose(bonus, 3, cache=context)
        want_tokens, want_z = ref.propose(np.concatenate(history), bonus, 3)
        assert np.array(drafts).tolist() == want_tokens.tolist()
        assert float(np.abs(np.array(z) - want_z).max() / np.abs(want_z).max()) < FP32_TOL
        block = mx.concatenate([mx.array([bonus]), drafts])[None]
        vlogits, vtaps = target.verify(block, cache, tap_layers=d.target_layer_ids)
        target.commit(cache, accepted + 1)
        d.add_context(vtaps[:accepted + 1], context.length, context)
        history.append(np.array(vtaps[:accepted + 1], dtype=np.float64))
        bonus = int(mx.argmax(vlogits[0, accepted]))
    assert context.length == 9 + 3 + 1 + 4 + 2  # past the 5-key window: the cache stays at 4 keys
    assert context.nbytes == 2 * 2 * tiny.KV_HEADS * (tiny.WINDOW - 1) * tiny.HEAD_DIM * 4
    assert d.length == 0                        # the drafter's own cache was never touched


def test_drafter_for_a_shallower_or_wider_target_is_refused():
    with pytest.raises(DrafterError, match=r"out of range for a 3-layer target"):
        load_drafter(tiny.DRAFTER, nemotron_target(layers="M*E"))
    with pytest.raises(DrafterError, match="vocab_size 256 != target vocab_size 300"):
        load_drafter(tiny.DRAFTER, nemotron_target(vocab=300))
