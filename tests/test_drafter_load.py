"""Loading a drafter: NVIDIA's config fields, refusals of unsupported variants and of drafters
that do not fit the target, and the weight-load gate (corrupted, missing or unloaded tensors)."""

import copy
import hashlib
import json
import os
import shutil

import mlx.core as mx
import pytest

from fixtures.drafter import tiny

import mlx_dspark.drafters.base as dr
from mlx_dspark.models.weights import weight_gate
from mlx_dspark.drafters import load_drafter
from mlx_dspark.drafters.config import DrafterError, parse_config

# The fields of NVIDIA's released config.json (docs/design.md §6), tensors aside.
NVIDIA = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 2688,
    "intermediate_size": 6144, "num_hidden_layers": 6, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "vocab_size": 131072, "layer_types": ["sliding_attention"] * 6, "sliding_window": 1024,
    "attention_sink_bias": True, "block_size": 8, "mask_token_id": 990,
    "target_layer_ids": [1, 5, 19, 29, 41, 51],
    "eagle_aux_hidden_state_layer_ids": [2, 6, 20, 30, 42, 52],
    "dflash_config": {"causal": True, "use_swa": True, "swa_window_size": 1024,
                      "attention_sink_bias": True, "mask_token_id": 990,
                      "target_layer_ids": [1, 5, 19, 29, 41, 51], "sample_from_anchor": False},
    "dspark_bonus_anchor": True, "sample_from_anchor": False, "dspark_fixup_head_type": "markov",
    "markov_head_type": "vanilla", "markov_rank": 512, "dspark_markov_rank": 512,
    "has_embed_tokens": True, "has_lm_head": False, "dtype": "bfloat16",
    "quantization_config": {"quant_algo": "W4A16_NVFP4"},
}


def test_nvidia_config_parses_to_the_documented_drafter():
    c = parse_config(NVIDIA)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        2688, 6, 32, 2, 128)
    assert c.windows == (1024,) * 6 and c.attention_sinks and c.rope_theta == 10000
    assert c.target_layer_ids == (1, 5, 19, 29, 41, 51)
    assert (c.block_size, c.mask_token_id, c.markov_rank) == (8, 990, 512)
    assert c.has_embed_tokens


def test_tap_layers_come_from_eagle_ids_minus_one_when_alone():
    cfg = copy.deepcopy(NVIDIA)
    del cfg["target_layer_ids"], cfg["dflash_config"]["target_layer_ids"]
    assert parse_config(cfg).target_layer_ids == (1, 5, 19, 29, 41, 51)


def test_window_from_dflash_config_when_layer_types_absent():
    cfg = copy.deepcopy(NVIDIA)
    del cfg["layer_types"], cfg["sliding_window"]
    assert parse_config(cfg).windows == (1024,) * 6


def _edit(path, value):
    def apply(cfg):
        d = cfg
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return apply


@pytest.mark.parametrize("edit, message", [
    (_edit("architectures", ["DFlashDraftModel"]), "only NVIDIA's Qwen3DSparkModel"),
    (_edit("dflash_config.causal", False), "bidirectional block attention"),
    (_edit("dflash_config.causal", KeyError), "bidirectional block attention"),
    (_edit("dspark_bonus_anchor", False), "anchor-first block"),
    (_edit("sample_from_anchor", True), "contradictory"),
    (lambda c: (c.update(sample_from_anchor=True), c["dflash_config"].update(sample_from_anchor=True)),
     "sample_from_anchor=true"),
    (_edit("has_lm_head", True), "own lm_head"),
    (_edit("enable_confidence_head", True), "confidence head"),
    (_edit("draft_vocab_size", 32000), "reduced draft vocabulary"),
    (_edit("dspark_fixup_head_type", "none"), "dspark_fixup_head_type 'none'"),
    (_edit("markov_head_type", "gated"), "markov_head_type 'gated'"),
    (_edit("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (_edit("hidden_act", "gelu"), "hidden_act 'gelu'"),
    (_edit("layer_types", ["chunked_attention"] * 6), "layer type 'chunked_attention'"),
])
def test_unsupported_variants_are_refused_by_name(edit, message):
    cfg = copy.deepcopy(NVIDIA)
    edit(cfg)
    with pytest.raises(DrafterError, match="unsupported drafter variant|contradictory") as e:
        parse_config(cfg, "x/config.json")
    assert message in str(e.value) and str(e.value).startswith("x/config.json: ")


@pytest.mark.parametrize("edit, message", [
    (_edit("eagle_aux_hidden_state_layer_ids", [1, 5, 19, 29, 41, 51]), r"must be target_layer_ids \+ 1"),
    (_edit("dflash_config.swa_window_size", 512), "contradictory"),
    (_edit("dflash_config.mask_token_id", 991), "contradictory"),
    (lambda c: (c.update(mask_token_id=131072), c["dflash_config"].update(mask_token_id=131072)),
     "mask_token_id 131072 not in"),
    (_edit("block_size", 1), "block_size 1"),
    (lambda c: (c.pop("markov_rank"), c.pop("dspark_markov_rank")), "no markov_rank"),
])
def test_inconsistent_configs_are_refused(edit, message):
    cfg = copy.deepcopy(NVIDIA)
    edit(cfg)
    with pytest.raises(DrafterError, match=message):
        parse_config(cfg)


def copy_fixture(tmp_path, edit_config=None, edit_weights=None):
    path = tmp_path / "drafter"
    shutil.copytree(tiny.DRAFTER, path)
    if edit_config:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if edit_weights:
        w = mx.load(str(path / "model.safetensors"))
        edit_weights(w)
        mx.save_safetensors(str(path / "model.safetensors"), w)
    tiny.write_receipt(str(path))
    return str(path)


@pytest.mark.parametrize("target, message", [
    (dict(num_hidden_layers=3), r"target_layer_ids \[0, 2, 3\] out of range for a 3-layer target"),
    (dict(hidden_size=128), "hidden_size 64 != target hidden_size 128"),
    (dict(vocab_size=512), "vocab_size 256 != target vocab_size 512"),
])
def test_drafter_for_another_target_is_refused(target, message):
    t = tiny.ArrayTarget()
    for k, v in target.items():
        setattr(t.config, k, v)
    with pytest.raises(DrafterError, match=message + r".*wrong drafter for this target"):
        load_drafter(tiny.DRAFTER, t)


def test_drafter_declaring_another_tap_width_is_refused(tmp_path):
    path = copy_fixture(tmp_path, edit_config=lambda c: c.update(target_hidden_size=96))
    with pytest.raises(DrafterError, match="target_hidden_size 96 != target hidden_size 64"):
        load_drafter(path, tiny.ArrayTarget())


def test_unconverted_checkpoint_is_refused(tmp_path):
    path = copy_fixture(tmp_path, edit_config=lambda c: c.pop("quantization"))
    with pytest.raises(DrafterError, match="not a converted checkpoint.*mlx-dspark convert"):
        load_drafter(path, tiny.ArrayTarget())


def test_gate_reports_every_tensor_matching():
    for nvfp4 in ("quantized", "dequantized"):
        d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), nvfp4=nvfp4)
        assert d.gate_report == "46/46 tensors match"


def test_missing_tensor_is_refused_by_name(tmp_path):
    path = copy_fixture(tmp_path, edit_weights=lambda w: w.pop("layers.1.mlp.down_proj.scales"))
    with pytest.raises(DrafterError, match="missing tensor layers.1.mlp.down_proj.scales"):
        load_drafter(path, tiny.ArrayTarget())
    path = copy_fixture(tmp_path / "b", edit_weights=lambda w: w.pop("layers.0.self_attn.attention_sink_bias"))
    with pytest.raises(DrafterError, match="missing tensor layers.0.self_attn.attention_sink_bias"):
        load_drafter(path, tiny.ArrayTarget())


@pytest.mark.parametrize("name, value, message", [
    ("fc.scales", mx.zeros((64, 6), mx.uint8), r"fc.scales is mlx.core.uint8 \(64, 6\)"),
    ("norm.weight", mx.zeros((64,), mx.uint8), "norm.weight is mlx.core.uint8"),
    ("lm_head.weight", mx.zeros((256, 64), mx.bfloat16), r"unexpected tensors \['lm_head.weight'\]"),
])
def test_wrong_or_unexpected_tensors_are_refused(tmp_path, name, value, message):
    path = copy_fixture(tmp_path, edit_weights=lambda w: w.update({name: value}))
    with pytest.raises(DrafterError, match=message):
        load_drafter(path, tiny.ArrayTarget())


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = copy_fixture(tmp_path)
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(DrafterError, match=r"model.safetensors: .*\(truncated\)"):
        load_drafter(path, tiny.ArrayTarget(), verify="none")


@pytest.mark.parametrize("nvfp4", ["quantized", "dequantized"])
@pytest.mark.parametrize("name", ["fc.weight", "layers.0.mlp.up_proj.scales",
                                  "markov_head.markov_w2.weight_scale_2",
                                  "layers.1.self_attn.k_norm.weight", "embed_tokens.weight"])
def test_gate_refuses_a_tensor_loaded_differently_from_the_file(monkeypatch, name, nvfp4):
    """A loader that hands the model different bytes than the file holds (one bit flipped)."""
    read = dr.read_weights

    def corrupting_read(path, *args, **kwargs):
        w, origin = read(path, *args, **kwargs)
        t = w[name]
        raw = t.view(mx.uint8) if t.ndim else t.reshape(1).view(mx.uint8)
        flipped = mx.concatenate([raw[:3], raw[3:4] ^ 1, raw[4:]]).view(t.dtype).reshape(t.shape)
        w[name] = flipped
        return w, origin

    monkeypatch.setattr(dr, "read_weights", corrupting_read)
    with pytest.raises(DrafterError, match=f"weight-load gate refused.*{name}"):
        load_drafter(tiny.DRAFTER, tiny.ArrayTarget(), nvfp4=nvfp4)


def test_gate_refuses_weights_changed_after_loading():
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget())
    d.layers[1].self_attn.o_proj.weight = d.layers[1].self_attn.o_proj.weight * 1.0001
    with pytest.raises(DrafterError, match="layers.1.self_attn.o_proj.weight .*differ"):
        weight_gate(d, tiny.DRAFTER)
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget())
    del d.layers[0].self_attn["attention_sink_bias"]  # a tensor that never reached the model
    with pytest.raises(DrafterError, match="attention_sink_bias .*not loaded into the drafter"):
        weight_gate(d, tiny.DRAFTER)


def test_gate_refuses_when_nothing_is_comparable(tmp_path):
    d = load_drafter(tiny.DRAFTER, tiny.ArrayTarget())
    os.makedirs(tmp_path / "empty")
    mx.save_safetensors(str(tmp_path / "empty" / "model.safetensors"), {})
    with pytest.raises(DrafterError, match="no tensor could be compared"):
        weight_gate(d, str(tmp_path / "empty"))


def test_file_changed_after_conversion_is_refused_by_its_receipt(tmp_path):
    path = copy_fixture(tmp_path)
    f = os.path.join(path, "model.safetensors")
    digest = hashlib.sha256(open(f, "rb").read()).hexdigest()
    with open(os.path.join(path, "MERERUN_CONVERSION.json"), "w") as fh:
        json.dump({"outputs": {"model.safetensors": {"size": os.path.getsize(f),
                                                     "sha256": digest}}}, fh)
    assert load_drafter(path, tiny.ArrayTarget()).gate_report == "46/46 tensors match"
    data = bytearray(open(f, "rb").read())
    data[-5] ^= 0x10  # one bit inside the last tensor's data
    open(f, "wb").write(bytes(data))
    with pytest.raises(DrafterError, match="differs from the conversion receipt"):
        load_drafter(path, tiny.ArrayTarget())
