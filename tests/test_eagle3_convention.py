"""EAGLE-3 heads count their auxiliary layers two ways: vLLM's (ids count layers done, the
default) and SGLang's (one later). A head declares SGLang's with
``eagle_aux_hidden_state_layer_ids_convention: "sglang"``; a head whose taps do not fit the
target, counted its way, is refused naming the file and the field. On the synthetic head
(ids [2, 3, 5] for a 5-layer target: layers 1, 2, 4 counted vLLM's way) through the real
converter."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_dspark.drafters import load_drafter
from mlx_dspark.drafters.eagle3 import CONVENTION_FIELD, parse_config
from mlx_dspark.models.nemotron_h import load_target
from mlx_dspark.models.weights import CheckpointError
from test_eagle3 import _copy as edited

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mlx_dspark.converter import convert
    from testkit.synthetic import synth_eagle3, synth_target
    root = tmp_path_factory.mktemp("eagle3-convention")
    synth_target(root / "tsrc")
    synth_eagle3(root / "hsrc")
    synth_eagle3(root / "sglang", aux=(1, 2, 4),
                 edit=lambda t, c, q: c["eagle_config"].update({CONVENTION_FIELD: "sglang"}))
    return (convert(str(root / "tsrc"), root / "target", progress=False),
            convert(str(root / "hsrc"), root / "head", progress=False),
            convert(str(root / "sglang"), root / "sglang-head", progress=False))


def test_each_convention_maps_the_ids_to_the_layers_it_means():
    base = {"architectures": ["LlamaForCausalLMEagle3"], "num_attention_heads": 4,
            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}
    ids = {"eagle_aux_hidden_state_layer_ids": [2, 20, 49]}
    vllm = parse_config({**base, "eagle_config": ids}, "c", 52)
    sglang = parse_config({**base, "eagle_config": {**ids, CONVENTION_FIELD: "sglang"}}, "c", 52)
    top = parse_config({**base, **ids, CONVENTION_FIELD: "sglang"}, "c", 52)
    assert vllm.target_layer_ids == (1, 19, 48) and vllm.convention == "vllm"
    assert sglang.target_layer_ids == top.target_layer_ids == (2, 20, 49)


def test_the_converter_keeps_the_convention_and_an_sglang_head_taps_the_same_layers(converted):
    tdir, vllm_dir, sglang_dir = converted
    assert json.loads((sglang_dir / "config.json").read_text())["eagle_config"][
        CONVENTION_FIELD] == "sglang"
    target = load_target(str(tdir))
    vllm, sglang = (load_drafter(str(d), target) for d in (vllm_dir, sglang_dir))
    # [2, 3, 5] counted vLLM's way and [1, 2, 4] counted SGLang's are the same taps
    assert vllm.target_layer_ids == sglang.target_layer_ids == [1, 2, 4]


@pytest.mark.parametrize("edit, message", [
    # the vLLM-counted head declared SGLang's: id 5 would be a sixth layer
    (lambda c: c["eagle_config"].update({CONVENTION_FIELD: "sglang"}),
     r"config\.json: eagle_aux_hidden_state_layer_ids \[2, 3, 5\] out of range for a 5-layer "
     r"target: counted the sglang way \(eagle_aux_hidden_state_layer_ids_convention\), ids "
     r"0\.\.4 tap its layers 0\.\.4"),
    # counted vLLM's way, id 0 is the embedding, which no tap is
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 4]),
     r"config\.json: eagle_aux_hidden_state_layer_ids \[0, 2, 4\] out of range for a 5-layer "
     r"target: counted the vllm way \(eagle_aux_hidden_state_layer_ids_convention\), ids "
     r"1\.\.5 tap its layers 0\.\.4"),
    (lambda c: c["eagle_config"].update({CONVENTION_FIELD: "trtllm"}),
     r"config\.json: eagle_aux_hidden_state_layer_ids_convention 'trtllm' is not one of "
     r"'vllm', 'sglang'"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids="2,3,5"),
     r"config\.json: eagle_aux_hidden_state_layer_ids must be a list of integers"),
])
def test_a_head_whose_taps_do_not_fit_is_refused_naming_the_file_and_field(
        converted, tmp_path, edit, message):
    tdir, vllm_dir, _ = converted
    with pytest.raises(CheckpointError, match=message):
        load_drafter(str(edited(tmp_path, vllm_dir, edit)), load_target(str(tdir)),
                     verify="none")


def test_the_same_head_under_either_convention_drafts_the_same_tokens(converted):
    tdir, vllm_dir, sglang_dir = converted
    target = load_target(str(tdir))
    prompt = [3, 14, 15, 92, 65, 35]
    out = []
    for d in (vllm_dir, sglang_dir):
        drafter = load_drafter(str(d), target)
        taps = target.step(mx.array([prompt]), target.make_cache(),
                           tap_layers=drafter.target_layer_ids)[1]
        drafter.add_context(taps[:-1], 0, tokens=prompt[:-1])
        out.append(drafter.propose(prompt[-1], 4)[0].tolist())
    assert out[0] == out[1]
