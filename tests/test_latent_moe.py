"""A latent MoE (``moe_latent_size``, issue 40.3: Nemotron 3 Super and Ultra) in each layout a
user has (Hugging Face, mlx-lm's at several precisions, a ModelOpt NVFP4 export through
``mlx-dspark convert`` with its latent projections quantized or in BF16) computes what mlx-lm's
own ``nemotron_h`` computes on the same weights (float32 logits within 1e-5 relative, greedy
tokens equal); the MTP block's latent MoE layer equals mlx-lm's ``NemotronHMoE``; speculation
stays exact; and a config.json that contradicts the tensors is refused in one line by the
loader and by the converter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.converter import convert
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.open_files import import_mlx_lm
from testkit.latent import LATENT, mlx_lm_model_on, modelopt_nvfp4, save_hf
from testkit.mlx_lm_layouts import mlx_lm_convert, mlx_lm_greedy, with_config
from testkit.oracle_drafter import OracleDrafter
from testkit.toy import random_drafter

mlx_lm_utils = import_mlx_lm("mlx_lm.utils")
mlx_lm_nh = import_mlx_lm("mlx_lm.models.nemotron_h")
PROMPT = [1, 5, 9, 33, 2, 7, 8, 11, 40, 41, 42, 43, 60, 61, 3, 4, 5, 6, 7, 8]
MLX_LM = {"mlx-lm-fp32": dict(dtype="float32"), "mlx-lm-bf16": dict(dtype="bfloat16"),
          "mlx-lm-affine-4bit": dict(quantize=True, q_bits=4, q_group_size=32,
                                     dtype="bfloat16"),
          "mlx-lm-nvfp4": dict(quantize=True, q_mode="nvfp4", dtype="bfloat16")}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (directory the runtime loads, mlx-lm's model on the same weights, float32)."""
    root = tmp_path_factory.mktemp("latent")
    hf, _ = save_hf(root / "hf")
    out = {"hf": (hf, _mlx_lm_load(hf))}
    for name, options in MLX_LM.items():
        path = mlx_lm_convert(hf, root / name, **options)
        out[name] = (path, _mlx_lm_load(path))
    config = json.loads((hf / "config.json").read_text())
    for name, latent in (("modelopt-nvfp4", True), ("modelopt-nvfp4-bf16-latent", False)):
        export, dense = modelopt_nvfp4(hf, root / f"{name}-export", quantize_latent=latent)
        path = convert(str(export), root / name, progress=False)
        out[name] = (path, mlx_lm_model_on(config, {k: v for k, v in dense.items()
                                                    if not k.startswith("mtp.")}))
    return out


def _mlx_lm_load(path):
    model, _ = mlx_lm_utils.load_model(Path(path))
    model.set_dtype(mx.float32)
    return model


def _rel(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


NAMES = ["hf", *MLX_LM, "modelopt-nvfp4", "modelopt-nvfp4-bf16-latent"]


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_tokens_equal_mlx_lm_on_the_same_weights(made, name):
    path, ref = made[name]
    target = md.load_target(str(path), dtype="float32")
    assert target.config.moe_latent_size == LATENT
    for ids in (PROMPT, PROMPT[:5]):            # the chunked scan, and the serial one
        assert _rel(target(mx.array([ids])), ref(mx.array([ids]))) < 1e-5
    pair = md.load(str(path), dtype="float32", warm=False)
    assert md.generate(pair, PROMPT, max_tokens=12).tokens == mlx_lm_greedy(ref, PROMPT, 12)


def test_the_latent_projections_stay_as_modelopt_exported_them(made):
    quantized = md.load_target(str(made["modelopt-nvfp4"][0]), dtype="float32")
    bf16 = md.load_target(str(made["modelopt-nvfp4-bf16-latent"][0]), dtype="float32")
    moe = next(b.mixer for b in quantized.layers if b.kind == "E")
    assert type(moe.fc1_latent_proj).__name__ == "NVFP4Linear"
    moe = next(b.mixer for b in bf16.layers if b.kind == "E")
    assert type(moe.fc1_latent_proj).__name__ == "Linear"


@pytest.mark.parametrize("name", ["hf", "modelopt-nvfp4"])
def test_the_mtp_block_s_latent_moe_layer_equals_mlx_lm_s(made, name):
    path, _ = made[name]
    target = md.load_target(str(path), dtype="float32")
    drafter = md.load_drafter("mtp", target, dtype="float32")
    matched, total = drafter.gate_report.split()[0].split("/")
    assert matched == total and any("latent" in k for k, _ in
                                    _flat(drafter.layers[1].mixer.parameters()))
    mine = drafter.layers[1].mixer
    theirs = mlx_lm_nh.NemotronHMoE(mlx_lm_nh.ModelArgs.from_dict(
        json.loads((Path(path) / "config.json").read_text())))
    theirs.load_weights(_as_mlx_lm(mine))
    x = mx.random.normal((1, 6, target.config.hidden_size), key=mx.random.key(3))
    assert _rel(mine(x), theirs(x)) < 1e-5


def _flat(params):
    from mlx.utils import tree_flatten
    return tree_flatten(params)


def _as_mlx_lm(moe) -> list:
    """Our MoE layer's weights, dequantized, under mlx-lm's names."""
    layers = {"switch_mlp.fc1": moe.experts.up_proj, "switch_mlp.fc2": moe.experts.down_proj,
              "shared_experts.up_proj": moe.shared_experts.up_proj,
              "shared_experts.down_proj": moe.shared_experts.down_proj,
              "fc1_latent_proj": moe.fc1_latent_proj, "fc2_latent_proj": moe.fc2_latent_proj}
    return [(f"{k}.weight", _dense(layer)) for k, layer in layers.items()] + [
        ("gate.weight", moe.gate.weight),
        ("gate.e_score_correction_bias", moe.gate.e_score_correction_bias)]


def _dense(layer):
    if "scales" not in layer:
        return layer.weight
    w = mx.dequantize(layer.weight, layer.scales, group_size=16, bits=4, mode="nvfp4",
                      dtype=mx.float32)
    return w * layer.weight_scale_2[..., None, None]


@pytest.mark.parametrize("name", ["hf", "mlx-lm-affine-4bit", "modelopt-nvfp4"])
def test_speculation_is_lossless_on_a_latent_target(made, name):
    path, ref = made[name]
    target = md.load_target(str(path), dtype="float32")
    serial = mlx_lm_greedy(ref, PROMPT, 20)
    drafters = [random_drafter(target, tap_layers=(0, 3)),
                OracleDrafter(PROMPT + serial, target.config.vocab_size, acceptance=0.8,
                              target_layer_ids=(5,), seed=1)]
    if not name.startswith("mlx-lm"):
        drafters.append(md.load_drafter("mtp", target, dtype="float32"))
    for drafter in drafters:
        pair = md.Pair(target, drafter)
        spec = md.generate(pair, PROMPT, max_tokens=20, speculative="on", num_draft=3)
        assert spec.tokens == serial and spec.stats.rounds > 0
        if isinstance(drafter, OracleDrafter):
            assert spec.stats.accepted > spec.stats.rounds     # verify commits drafts


# ----------------------------------------------------------------------- refusals


def one_line(excinfo) -> str:
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


@pytest.mark.parametrize("name", ["hf", "mlx-lm-affine-4bit", "modelopt-nvfp4"])
def test_a_config_without_moe_latent_size_over_latent_tensors_is_refused(made, tmp_path, name):
    bad = with_config(made[name][0], tmp_path / "bad", moe_latent_size=None)
    for load in (md.load_target, md.load):
        with pytest.raises(CheckpointError) as e:
            load(str(bad), verify="none")
        assert one_line(e).startswith(f"{bad / 'config.json'}: no moe_latent_size, but the "
                                      f"tensors hold a latent MoE (backbone.layers.2.mixer."
                                      f"fc1_latent_proj.weight)")


def test_a_moe_latent_size_the_tensors_do_not_have_is_refused(made, tmp_path):
    bad = with_config(made["hf"][0], tmp_path / "bad", moe_latent_size=LATENT // 2)
    with pytest.raises(CheckpointError) as e:
        md.load_target(str(bad))
    assert one_line(e) == (f"{bad / 'config.json'}: moe_latent_size {LATENT // 2}, but "
                           f"backbone.layers.2.mixer.fc1_latent_proj.weight projects to "
                           f"{LATENT}: this config.json does not describe these weights")


def test_the_converter_reads_latent_or_not_from_the_tensors(made, tmp_path, capsys):
    export = Path(str(made["modelopt-nvfp4"][0]) + "-export")
    for value, words in ((None, "no moe_latent_size, but the tensors hold a latent MoE"),
                         (LATENT * 2, f"moe_latent_size {LATENT * 2}, but backbone.layers.2."
                                      f"mixer.fc1_latent_proj.weight projects to {LATENT}")):
        bad = with_config(export, tmp_path / f"bad-{value}", moe_latent_size=value)
        with pytest.raises(ConversionError, match=words):
            convert(str(bad), tmp_path / f"out-{value}", progress=False)
        assert not (tmp_path / f"out-{value}").exists()
        assert cli.main(["convert", str(bad), "-o", str(tmp_path / "cli")]) != 0
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"{bad / 'config.json'}: " in err and "moe_latent_size" in err
