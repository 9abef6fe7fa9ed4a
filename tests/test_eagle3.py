"""An EAGLE-3 head as a drafter: its proposals equal a float64 NumPy reference written from
vLLM's ``llama_eagle3`` (tests/reference_eagle3.py), rejected drafts leave its cache as the committed tokens alone would, the
converter carries SpecForge's layout over byte for byte, and the loader recognises it, passes
it through the weight-load gate, and refuses a head for another target or an unknown
architecture in one line."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import testkit.reference_eagle3 as R
from testkit.loop_helpers import serial_greedy
from mlx_dspark.models.weights import CheckpointError
from mlx_dspark.drafters import load_drafter
from mlx_dspark.drafters.eagle3 import Eagle3Drafter, parse_config
from mlx_dspark.request import Request
from mlx_dspark.decode.session import Session
from mlx_dspark.decode.batch import decode
from mlx_dspark.models.nemotron_h import load_target
from testkit.toy import random_eagle3_weights, tiny_target

PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 3, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module", params=[False, True], ids=["shared-embedding", "own-embedding"])
def head(target, request):
    w, config = random_eagle3_weights(target, seed=3, own_embedding=request.param)
    cfg = parse_config(config, "toy", target.config.num_hidden_layers)
    d = Eagle3Drafter(cfg, w, target, mx.float32, "embed_tokens.weight" not in w)
    mx.eval(d.parameters())
    return d, w, config


def taps_of(target, drafter, tokens):
    return target.step(mx.array([tokens]), target.make_cache(),
                       tap_layers=drafter.target_layer_ids)[1]


def test_proposals_and_logits_match_the_float64_reference(target, head):
    d, weights, config = head
    w = {k: np.array(v).astype(np.float64) for k, v in weights.items()}
    embed = w.get("embed_tokens.weight", np.array(target.embeddings, np.float64))
    t = {"eps": 1e-6, "embed": embed, "heads": 4, "kv_heads": 2, "head_dim": 16,
         "theta": 10000.0, "vocab": target.config.vocab_size}
    taps = taps_of(target, d, PROMPT)
    cache = d.make_cache()
    d.add_context(taps[:7], 0, cache, PROMPT[:7])
    d.add_context(taps[7:], 7, cache, PROMPT[7:])
    got, logits = d.propose(44, 5, cache=cache)
    want, want_logits = R.propose(np.array(taps, np.float64), PROMPT, 44, 5, w, t)
    assert got.tolist() == want
    logits = np.array(logits)
    assert np.array_equal(np.isinf(logits), np.isinf(want_logits))     # outside the draft vocab
    finite = np.isfinite(want_logits)
    np.testing.assert_allclose(logits[finite], want_logits[finite], atol=1e-4, rtol=0)


def test_rejected_drafts_leave_the_cache_as_the_committed_tokens_alone(target, head):
    d = head[0]
    session = Session(target, d)
    out = list(decode(session, Request(PROMPT, max_tokens=17, num_draft=4, speculative="on")))
    session.flush()
    fresh = d.make_cache()
    d.add_context(taps_of(target, d, session.tokens), 0, fresh, session.tokens)
    assert session.draft_cache.length == fresh.length == len(PROMPT) + len(out) - 1
    for a, b in zip(session.draft_cache.arrays(), fresh.arrays()):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- convert, load


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mlx_dspark.converter import convert
    from testkit.synthetic import synth_eagle3, synth_target
    root = tmp_path_factory.mktemp("eagle3")
    synth_target(root / "tsrc")
    src = synth_eagle3(root / "hsrc")
    return (src, convert(str(root / "tsrc"), root / "target", progress=False),
            convert(str(root / "hsrc"), root / "head", progress=False))


def test_the_converter_carries_the_eagle3_layout_byte_for_byte(converted):
    src, _, head = converted
    from test_convert import load_out, out_bytes
    w = load_out(head)
    assert set(w) == {n.replace(".weight_scale", ".scales") if n.endswith(".weight_scale")
                      else n for n in src}
    for name in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "d2t"):
        assert out_bytes(w[name]) == src[name][2], name
    assert out_bytes(w["midlayer.mlp.up_proj.weight"]) == src["midlayer.mlp.up_proj.weight"][2]
    assert np.array(w["t2d"]).astype(np.uint8).tobytes() == src["t2d"][2]
    receipt = json.loads((head / "MERERUN_CONVERSION.json").read_text())
    assert receipt["model_kind"] == "eagle3"


def test_a_converted_eagle3_head_loads_through_the_weight_load_gate(converted):
    _, tdir, hdir = converted
    target = load_target(str(tdir))
    d = load_drafter(str(hdir), target)
    assert isinstance(d, Eagle3Drafter)
    assert d.gate_report == "21/21 tensors match"
    out = list(decode(Session(target, d), Request([1, 2, 3], max_tokens=8, num_draft=3,
                                                  speculative="on")))
    assert out == serial_greedy(target, [1, 2, 3], 8)


def _copy(tmp_path, hdir, edit):
    out = tmp_path / "h"
    shutil.copytree(hdir, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(vocab_size=4096), "vocab_size 4096 != target vocab_size 128"),
    (lambda c: c.update(target_hidden_size=96), "target_hidden_size 96 != target hidden_size 64"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 40]),
     r"eagle_aux_hidden_state_layer_ids \[2, 3, 40\] out of range for a 5-layer target"),
    (lambda c: c.update(architectures=["MedusaModel"]), r"architectures \['MedusaModel'\] is no "
                                                        r"drafter this runtime runs"),
    (lambda c: c.update(num_hidden_layers=2), "one decoder layer only"),
])
def test_a_head_for_another_target_or_of_another_kind_is_refused_naming_why(
        converted, tmp_path, edit, message):
    _, tdir, hdir = converted
    target = load_target(str(tdir))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(str(_copy(tmp_path, hdir, edit)), target, verify="none")


def test_a_head_whose_weights_differ_from_the_file_is_refused_by_the_gate(converted):
    from mlx_dspark.models.weights import weight_gate
    _, tdir, hdir = converted
    d = load_drafter(str(hdir), load_target(str(tdir)))
    d.midlayer.hidden_norm.weight = d.midlayer.hidden_norm.weight * 2
    with pytest.raises(CheckpointError, match="midlayer.hidden_norm.weight.*differ"):
        weight_gate(d, str(hdir))


def test_load_picks_each_drafter_by_name_or_config(converted, monkeypatch):
    import mlx_dspark as md
    from mlx_dspark import loading
    from mlx_dspark.drafters.mtp import MTPDrafter
    _, tdir, hdir = converted
    monkeypatch.setattr(loading, "load_tokenizer", lambda *a: None)   # synthetic: no real one
    assert isinstance(md.load(str(tdir), "mtp").drafter, MTPDrafter)
    assert isinstance(md.load(str(tdir), str(hdir)).drafter, Eagle3Drafter)
    with pytest.raises(FileNotFoundError, match="demo drafter"):
        md.load(str(tdir), "eagle3")
