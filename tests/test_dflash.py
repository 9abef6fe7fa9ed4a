"""The DFlash drafter (drafters/dflash.py) against the float64 reference written from z-lab's
definition (tests/reference_dflash.py), on the demo target's real taps; its config refusals;
greedy speculation equal to serial greedy for every block size; exact rollback."""

import copy
import os

import mlx.core as mx
import numpy as np
import pytest

from testkit.loop_helpers import serial_greedy
from testkit.reference_drafter import read_safetensors
from testkit.reference_dflash import ReferenceDFlash

from mlx_dspark.decode.batch import decode
from mlx_dspark.decode.session import Session
from mlx_dspark.drafters import DEMO
from mlx_dspark.drafters.base import DrafterError
from mlx_dspark.drafters.config import check_fits
from mlx_dspark.drafters.dflash import DFlashDrafter, parse_config
from mlx_dspark.models.nemotron_h import load_target
from mlx_dspark.request import Request
from mlx_dspark.stats import Stats
from testkit.toy import dflash_config, random_block_weights, random_dflash, tiny_target

FP32_TOL = 1e-4          # relative to the largest logit


@pytest.fixture(scope="module")
def demo_target():
    return load_target(str(DEMO / "target"), dtype=mx.float32)


@pytest.fixture(scope="module")
def demo_tensors():
    t = read_safetensors(os.path.join(DEMO, "target", "model.safetensors"))
    return t["backbone.embeddings.weight"], t["lm_head.weight"]


def pair(target, tensors, seed=0, **over):
    raw = dflash_config(target, tap_layers=(1, 3, 5), **over)
    cfg = parse_config(raw, "toy")
    w = random_block_weights(cfg, seed)
    drafter = DFlashDrafter(cfg, w, target, mx.float32, share_embedding=True)
    ref = ReferenceDFlash(raw, {k: np.array(v, np.float64) for k, v in w.items()}, *tensors)
    return drafter, ref


VARIANTS = {
    "full-and-narrow-window": {},
    "sliding-layers-causal-by-default": dict(is_causal=None, windows=(4, 6)),
    "scaled-and-capped": dict(input_embedding_scale=1.7, output_multiplier=0.6,
                              final_logit_softcapping=3.0),
    "block-4": dict(block_size=4),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rounds_on_the_demo_targets_taps_match_the_zlab_reference(demo_target, demo_tensors,
                                                                   variant):
    drafter, ref = pair(demo_target, demo_tensors, **VARIANTS[variant])
    if variant == "sliding-layers-causal-by-default":
        assert drafter.config.causal == (True, True)     # z-lab's rule, as the reference's
    target, cache, context = demo_target, demo_target.make_cache(), drafter.make_cache()
    prompt = mx.array([[17, 300, 9, 4000, 12, 12, 77, 1024, 5, 61, 130]])
    logits, taps = target.step(prompt, cache, tap_layers=drafter.target_layer_ids)
    drafter.add_context(taps, 0, context)
    history = [np.array(taps, np.float64)]
    bonus = int(mx.argmax(logits[0, -1]))
    n = drafter.max_draft
    for accepted in (2, 0, n, 1, 3):                    # the context outgrows every window
        accepted = min(accepted, n)
        drafts, z = drafter.propose(bonus, n, cache=context)
        want_tokens, want_z = ref.propose(np.concatenate(history), bonus, n)
        assert np.array(drafts).tolist() == want_tokens.tolist()
        assert float(np.abs(np.array(z) - want_z).max() / np.abs(want_z).max()) < FP32_TOL
        first, z1 = drafter.propose(bonus, 1, cache=context)   # a prefix of the same block
        assert np.array(first).tolist() == want_tokens[:1].tolist()
        block = mx.concatenate([mx.array([bonus]), drafts])[None]
        vlogits, vtaps = target.verify(block, cache, tap_layers=drafter.target_layer_ids)
        target.commit(cache, accepted + 1)
        drafter.add_context(vtaps[:accepted + 1], context.length, context)
        history.append(np.array(vtaps[:accepted + 1], np.float64))
        bonus = int(mx.argmax(vlogits[0, accepted]))


def test_the_reference_sees_a_broken_mask():
    # The oracle has teeth: a causal block (DSpark's mask) gives other drafts than DFlash's.
    target = tiny_target(seed=1)
    raw = dflash_config(target)
    cfg = parse_config(raw, "toy")
    w = random_block_weights(cfg, 0)
    causal = DFlashDrafter(parse_config(dict(raw, is_causal=True), "toy"), w, target,
                           mx.float32, share_embedding=True)
    emb = np.array(target.embeddings, np.float64)
    head = np.array(target.head.weight, np.float64)
    ref = ReferenceDFlash(raw, {k: np.array(v, np.float64) for k, v in w.items()}, emb, head)
    _, taps = target.step(mx.array([[3, 4, 5, 6, 7]]), target.make_cache(),
                          tap_layers=causal.target_layer_ids)
    causal.add_context(taps, 0)
    _, z = causal.propose(5, 7)
    _, want = ref.propose(np.array(taps, np.float64), 5, 7)
    assert float(np.abs(np.array(z) - want).max() / np.abs(want).max()) > 1e-2


REFUSED = [
    (lambda c: c.update(architectures=["Qwen3DSparkModel"]), "expected DFlashDraftModel"),
    (lambda c: c.update(markov_rank=64), "a DSpark drafter"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=4), "dynamic convolutions"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(draft_vocab_size=32), "reduced draft vocabulary"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn"}), "rope type 'yarn'"),
    (lambda c: c["dflash_config"].update(mask_token_id=10 ** 6), "mask_token_id"),
    (lambda c: c.update(block_size=1), "block_size 1"),
    (lambda c: c.update(is_causal=True, dflash_config=dict(c["dflash_config"], causal=False)),
     "contradictory"),
]


@pytest.mark.parametrize("edit,message", REFUSED)
def test_dflash_variants_not_implemented_are_refused_naming_the_file(edit, message):
    raw = copy.deepcopy(dflash_config(tiny_target(seed=1)))
    edit(raw)
    with pytest.raises(DrafterError, match=message) as e:
        parse_config(raw, "/x/config.json")
    assert str(e.value).startswith("/x/config.json")


@pytest.mark.parametrize("over,message", [
    (dict(tap_layers=(0, 9)), "out of range for a 6-layer target"),
    (dict(hidden_size=96), "hidden_size 96 != target hidden_size 64"),
    (dict(vocab_size=128), "vocab_size 128 != target vocab_size 97"),
])
def test_a_dflash_head_for_another_target_is_refused(over, message):
    target = tiny_target(seed=1)
    taps = over.pop("tap_layers", (0, 2))
    cfg = parse_config(dflash_config(target, tap_layers=taps, **over), "/x/config.json")
    with pytest.raises(DrafterError, match=message) as e:
        check_fits(cfg, target, "/x/config.json")
    assert str(e.value).startswith("/x/config.json")


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


PROMPTS = [[3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2], list(range(1, 30))]


@pytest.mark.parametrize("block", range(2, 9))
def test_greedy_speculation_equals_serial_for_every_block_size(target, block):
    drafter = random_dflash(target, seed=block, block_size=block)
    for prompt in PROMPTS:
        ref = serial_greedy(target, prompt, 20)
        for n in sorted({1, block - 1}):
            stats = Stats()
            out = list(decode(Session(target, drafter),
                              Request(prompt, max_tokens=20, num_draft=n, speculative="on"),
                              stats))
            assert out == ref
            assert stats.rounds > 0


def test_rollback_leaves_the_context_a_fresh_run_builds(target):
    # After rounds with rejections, the drafter's cache equals one fed the committed taps at once.
    drafter = random_dflash(target, seed=5)
    session = Session(target, drafter)
    list(decode(session, Request(PROMPTS[1], max_tokens=24, num_draft=7, speculative="on")))
    session.flush()
    _, taps = target.step(mx.array([session.tokens]), target.make_cache(),
                          tap_layers=drafter.target_layer_ids)
    fresh = drafter.make_cache()
    drafter.add_context(taps, 0, fresh)
    assert session.draft_cache.length == fresh.length == len(session.tokens)
    for (k, v), (fk, fv) in zip(session.draft_cache.layers, fresh.layers):
        assert k.shape == fk.shape
        assert float(mx.abs(k - fk).max()) < 1e-5 and float(mx.abs(v - fv).max()) < 1e-5
