"""The target's native MTP block as a drafter: its proposals equal a float64 NumPy reference
written from vLLM's ``nemotron_h_mtp`` (tests/reference_mtp.py), rejected drafts leave its cache exactly as the committed tokens
alone would, and a converted target's block loads through the weight-load gate (or is
refused in one line)."""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

import testkit.reference_mtp as R
from mlx_dspark.models.weights import CheckpointError
from mlx_dspark.drafters import load_drafter
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.models.nemotron_h import load_target
from testkit.toy import random_mtp_weights, tiny_target

load_mtp = partial(load_drafter, "mtp")

PATTERN = "*E"
PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def weights(target):
    return random_mtp_weights(target, PATTERN, seed=2)


@pytest.fixture(scope="module")
def drafter(target, weights):
    from mlx_dspark.drafters.mtp import MTPDrafter
    d = MTPDrafter(target, weights, PATTERN)
    mx.eval(d.parameters())
    return d


def reference_pieces(target, weights):
    c = target.config
    w = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    t = {"eps": c.layer_norm_epsilon, "embed": np.array(target.embeddings, np.float64),
         "norm_f": np.array(target.norm_f, np.float64),
         "lm_head": np.array(target.head.weight, np.float64), "heads": c.num_attention_heads,
         "kv_heads": c.num_key_value_heads, "top_k": c.num_experts_per_tok,
         "scaling": c.routed_scaling_factor}
    return w, t


def taps_of(target, drafter, tokens):
    _, taps = target.step(mx.array([tokens]), target.make_cache(),
                          tap_layers=drafter.target_layer_ids)
    return taps


def test_proposals_and_logits_match_the_float64_reference(target, weights, drafter):
    w, t = reference_pieces(target, weights)
    tokens, bonus = PROMPT, 44
    taps = taps_of(target, drafter, tokens)
    cache = drafter.make_cache()
    drafter.add_context(taps[:5], 0, cache, tokens[:5])        # in two pieces: the pending
    drafter.add_context(taps[5:], 5, cache, tokens[5:])        # row waits for its next token
    got, logits = drafter.propose(bonus, 5, cache=cache)
    want, want_logits = R.propose(np.array(taps, np.float64), tokens, bonus, 5, w, t, PATTERN)
    assert got.tolist() == want
    np.testing.assert_allclose(np.array(logits), want_logits, atol=1e-4, rtol=0)


def test_rejected_drafts_leave_the_cache_as_the_committed_tokens_alone(target, drafter):
    session = Session(target, drafter)
    out = list(decode(session, Request(PROMPT, max_tokens=17, num_draft=4, speculative="on")))
    session.flush()
    fed = session.tokens
    assert fed == PROMPT + out[:-1]
    fresh = drafter.make_cache()
    drafter.add_context(taps_of(target, drafter, fed), 0, fresh, fed)
    got, want = session.draft_cache, fresh
    assert got.length == want.length == len(fed)
    for a, b in zip(got.arrays(), want.arrays()):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
    # and the next proposal is the same from either
    assert drafter.propose(out[-1], 3, cache=got)[0].tolist() == \
        drafter.propose(out[-1], 3, cache=want)[0].tolist()


# --------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def converted_targets(tmp_path_factory):
    from mlx_dspark.converter import convert
    from testkit.synthetic import synth_target
    root = tmp_path_factory.mktemp("mtp")
    synth_target(root / "src", "MIXED_PRECISION")
    keep = convert(str(root / "src"), root / "keep", progress=False)
    drop = convert(str(root / "src"), root / "drop", keep_mtp=False, progress=False)
    return keep, drop


def test_a_converted_mtp_block_loads_through_the_weight_load_gate(converted_targets):
    target = load_target(str(converted_targets[0]))
    d = load_mtp(target)
    assert d.gate_report.endswith("tensors match")
    n = int(d.gate_report.split("/")[1].split()[0])
    assert n == int(d.gate_report.split("/")[0]) > 10
    taps = taps_of(target, d, [1, 2, 3, 4])
    cache = d.make_cache()
    d.add_context(taps, 0, cache, [1, 2, 3, 4])
    tokens, logits = d.propose(5, 3, cache=cache)
    assert logits.shape == (3, target.config.vocab_size)
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_a_target_converted_without_its_mtp_block_is_refused_in_one_line(converted_targets):
    target = load_target(str(converted_targets[1]))
    with pytest.raises(CheckpointError, match="converted without its MTP block.*--no-mtp"):
        load_mtp(target)


def test_an_mtp_tensor_that_differs_from_the_file_is_refused_by_the_gate(converted_targets):
    target = load_target(str(converted_targets[0]))
    d = load_mtp(target)
    d.layers[0].hnorm.weight = d.layers[0].hnorm.weight + 1
    from mlx_dspark.models.weights import weight_gate
    with pytest.raises(CheckpointError, match="mtp.layers.0.hnorm.weight.*differ"):
        weight_gate(d, str(converted_targets[0]), "mtp.")


def test_a_target_without_an_mtp_block_in_its_config_is_refused(target):
    target.path = "/nowhere"
    try:
        with pytest.raises(CheckpointError, match="declares no MTP block"):
            load_mtp(target)
    finally:
        del target.path
