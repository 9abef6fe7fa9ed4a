"""The tensors decide, not the config (issue 43, item 1): every shape-bearing value of a
target's or a drafter's ``config.json`` is checked, on its own and against the tensors'
shapes in the safetensors headers, before any weight is read; a hostile value is one line
naming ``config.json`` and the field (exit 1 on the command line, ValueError from
``md.load``), in every layout the loader takes and in ``convert``. Token ids are checked
against the table that exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.api import DEMO
from mlx_dspark.converter import convert
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.models import nemotron_h
from testkit.mlx_lm_layouts import dense_hf, mlx_lm_convert, with_config

from testkit.server_helpers import app_client, started_engine

MODELOPT = Path(__file__).parent / "fixtures" / "modelopt" / "target_bf16"


# id -> (config change, the words the one line must hold besides config.json)
TARGET_CASES = {
    "vocab past the table": ({"vocab_size": 2 ** 31}, "vocab_size 2147483648"),
    "vocab short of the table": ({"vocab_size": 4000}, "vocab_size 4000"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads 0"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
    "no kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads 0"),
    "heads the tensors do not have": ({"num_attention_heads": 8}, "num_attention_heads 8"),
    "head_dim the tensors do not have": ({"head_dim": 32}, "head_dim 32"),
    "no experts": ({"n_routed_experts": 0}, "n_routed_experts 0"),
    "experts the tensors do not have": ({"n_routed_experts": 16}, "n_routed_experts 16"),
    "top-k of zero": ({"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
    "top-k past the experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
    "expert groups not dividing": ({"n_group": 3}, "n_group 3"),
    "fewer layers than the tensors": ({"hybrid_override_pattern": "MEM*E"},
                                      "hybrid_override_pattern"),
    "more layers than the tensors": ({"hybrid_override_pattern": "MEM*EMM"},
                                     "hybrid_override_pattern"),
    "a layer of the wrong kind": ({"hybrid_override_pattern": "MEM*EE"},
                                  "layer 5 is 'E'"),
    "num_hidden_layers against the pattern": ({"num_hidden_layers": 7}, "num_hidden_layers 7"),
    "mamba heads the tensors do not have": ({"mamba_num_heads": 8}, "mamba_num_heads 8"),
    "mamba groups not dividing": ({"n_groups": 4}, "n_groups 4"),
    "mamba head_dim the tensors do not have": ({"mamba_head_dim": 16}, "mamba_head_dim 16"),
    "ssm state the tensors do not have": ({"ssm_state_size": 16}, "ssm_state_size 16"),
    "no conv kernel": ({"conv_kernel": 0}, "conv_kernel 0"),
    "max_position_embeddings 0": ({"max_position_embeddings": 0}, "max_position_embeddings 0"),
    "max_position_embeddings negative": ({"max_position_embeddings": -5},
                                         "max_position_embeddings -5"),
    "max_position_embeddings 1": ({"max_position_embeddings": 1}, "max_position_embeddings 1"),
    "negative epsilon": ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon -1.0"),
    "a size as a string": ({"hidden_size": "192"}, "hidden_size '192'"),
    "a time-step limit that is no pair": ({"time_step_limit": 5}, "time_step_limit 5"),
}


def refused_in_one_line(path: Path, words: str, monkeypatch, capsys, **load):
    """``md.load`` and ``mlx-dspark generate`` both refuse ``path`` in one line naming its
    config.json and ``words``, before any weight is read."""
    def no_weights(*a, **k):
        raise AssertionError("a weight was read before the config was refused")

    monkeypatch.setattr(nemotron_h, "read_weights", no_weights)
    with pytest.raises(ValueError) as e:
        md.load(str(path), drafter=None, **load)
    text = str(e.value)
    assert "\n" not in text and f"{path}/config.json: " in text and words in text, text
    assert cli.main(["generate", "--model", str(path), "-p", "x", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err == f"mlx-dspark generate: error: {text}\n", err


@pytest.mark.parametrize("case", TARGET_CASES)
def test_each_hostile_target_value_is_one_line_naming_config_json_and_the_field(
        case, tmp_path, monkeypatch, capsys):
    change, words = TARGET_CASES[case]
    refused_in_one_line(with_config(DEMO / "target", tmp_path / "m", **change), words,
                        monkeypatch, capsys)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The demo target in each layout the loader takes besides its own."""
    root = tmp_path_factory.mktemp("layouts")
    hf = dense_hf(DEMO / "target", root / "hf", dtype=mx.bfloat16)
    return {"hf": hf, "mlx-lm bf16": mlx_lm_convert(hf, root / "bf16", dtype="bfloat16"),
            "mlx-lm affine": mlx_lm_convert(hf, root / "affine", quantize=True, q_bits=4),
            "mlx-lm mxfp4": mlx_lm_convert(hf, root / "mxfp4", quantize=True, q_mode="mxfp4"),
            "mlx-lm nvfp4": mlx_lm_convert(hf, root / "nvfp4", quantize=True, q_mode="nvfp4")}


@pytest.mark.parametrize("layout", ["hf", "mlx-lm bf16", "mlx-lm affine", "mlx-lm mxfp4",
                                    "mlx-lm nvfp4"])
@pytest.mark.parametrize("case", ["vocab past the table", "heads the tensors do not have",
                                  "experts the tensors do not have", "a layer of the wrong kind",
                                  "mamba heads the tensors do not have"])
def test_every_layout_is_checked_against_its_own_tensors(layouts, layout, case, tmp_path,
                                                         monkeypatch, capsys):
    change, words = TARGET_CASES[case]
    refused_in_one_line(with_config(layouts[layout], tmp_path / "m", **change), words,
                        monkeypatch, capsys)


def _quantization(path: Path, **entries) -> dict:
    q = json.loads((path / "config.json").read_text())["quantization"]
    return {**q, **entries}


# id -> (quantization entries changed, words)
QUANT_CASES = {
    "bits MLX has no mode for": ({"bits": 7}, "at 7 bits"),
    "a group size MLX does not take": ({"group_size": 48}, "groups of 48"),
    "a mode MLX does not have": ({"mode": "int3"}, "mode 'int3'"),
    "an override of a module that does not exist":
        ({"backbone.layers.99.mixer.in_proj": {"group_size": 64, "bits": 4}},
         "quantization['backbone.layers.99.mixer.in_proj']: no such module"),
    "an override that is no object": ({"lm_head": [1, 2]},
                                      "quantization['lm_head'] must be an object"),
    "an override at a scheme MLX does not have": ({"lm_head": {"group_size": 16, "bits": 4}},
                                                  "quantization['lm_head'] mode 'affine'"),
    "an override with a key MLX does not take": (
        {"lm_head": {"group_size": 64, "bits": 4, "scale": 2}}, "'scale'"),
}


@pytest.mark.parametrize("case", QUANT_CASES)
def test_mlx_lm_quantization_is_what_mlx_lm_accepts(layouts, case, tmp_path, monkeypatch,
                                                    capsys):
    entries, words = QUANT_CASES[case]
    src = layouts["mlx-lm affine"]
    path = with_config(src, tmp_path / "m", quantization=_quantization(src, **entries))
    refused_in_one_line(path, words, monkeypatch, capsys)


@pytest.mark.parametrize("entries, words", [
    ({"group_size": 32}, "quantization.group_size 32"),
    ({"modules": {"backbone.layers.9.mixer.in_proj": "nvfp4"}},
     "quantization.modules['backbone.layers.9.mixer.in_proj'] 'nvfp4': no such module"),
])
def test_the_converted_layout_s_quantization_names_what_is_there(entries, words, tmp_path,
                                                                 monkeypatch, capsys):
    src = DEMO / "target"
    path = with_config(src, tmp_path / "m", quantization=_quantization(src, **entries))
    refused_in_one_line(path, words, monkeypatch, capsys)


def test_an_override_of_true_means_the_defaults_as_in_mlx_lm(layouts, tmp_path):
    src = layouts["mlx-lm affine"]
    path = with_config(src, tmp_path / "m", quantization=_quantization(src, lm_head=True))
    ref = md.generate(md.load(str(src), drafter=None), [5, 6, 7], max_tokens=4).tokens
    assert md.generate(md.load(str(path), drafter=None), [5, 6, 7], max_tokens=4).tokens == ref


@pytest.mark.parametrize("change, words", [
    ({"num_attention_heads": 0}, "num_attention_heads 0"),
    ({"ssm_state_size": 8}, "2 x n_groups"),
    ({"mamba_num_heads": 4}, "mamba_num_heads 4"),
    ({"max_position_embeddings": 0}, "max_position_embeddings 0"),
])
def test_convert_refuses_a_config_its_tensors_contradict_and_writes_nothing(change, words,
                                                                           tmp_path, capsys):
    src = with_config(MODELOPT, tmp_path / "src", **change)
    with pytest.raises(ConversionError) as e:
        convert(str(src), tmp_path / "out", progress=False)
    text = str(e.value)
    assert "\n" not in text and f"{src}/config.json: " in text and words in text, text
    assert not (tmp_path / "out").exists()
    assert cli.main(["convert", str(src), "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"mlx-dspark convert: error: {text}\n"


# kind -> the demo drafter directory
DRAFTERS = {"dspark": DEMO / "drafter", "dflash": DEMO / "dflash", "eagle3": DEMO / "eagle3"}


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("change, words", [
    ({"num_attention_heads": 0}, "num_attention_heads 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3: does not divide"),
    ({"head_dim": 0}, "head_dim 0"),
    ({"intermediate_size": -1}, "intermediate_size -1"),
    ({"vocab_size": "x"}, "vocab_size 'x'"),
    ({"rms_norm_eps": -1}, "rms_norm_eps -1"),
    ({"rope_theta": 0}, "rope_theta 0"),
])
def test_each_hostile_drafter_value_is_one_line_naming_config_json_and_the_field(
        kind, change, words, tmp_path, capsys):
    path = with_config(DRAFTERS[kind], tmp_path / kind, **change)
    with pytest.raises(ValueError) as e:
        md.load(drafter=str(path))
    text = str(e.value)
    assert "\n" not in text and f"{path}/config.json: {words}" in text, text
    assert cli.main(["generate", "--drafter", str(path), "-p", "x", "--max-tokens", "1"]) == 1
    assert capsys.readouterr().err == f"mlx-dspark generate: error: {text}\n"


@pytest.mark.slow
def test_the_server_refuses_a_vocab_past_the_table_at_load_in_one_line(tmp_path):
    # vocab_size 2**31 let a prompt of [1000000] read past the table: SIGSEGV (issue 43)
    path = with_config(DEMO / "target", tmp_path / "m", vocab_size=2 ** 31)
    r = subprocess.run([str(Path(sys.executable).parent / "mlx-dspark"), "serve", "--model",
                        str(path), "--port", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"{path}/config.json: vocab_size 2147483648 but the checkpoint's " \
           f"backbone.embeddings.weight has 4096 rows" in r.stderr


def test_ids_are_checked_against_the_table_that_exists():
    running = started_engine()
    engine = next(running)
    try:
        client = app_client(engine, "demo")
        rows = engine.pair.target.embeddings.shape[0]
        for ids, status in (([rows], 400), ([1000000], 400), ([rows - 1], 200)):
            r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
            assert r.status_code == status, r.text
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                 "logit_bias": {str(rows): 1}})
        assert r.status_code == 400 and "logit_bias" in r.text
    finally:
        running.close()
    with pytest.raises(ValueError, match=rf"token id {rows} is outside the model's vocabulary"):
        md.generate(md.load(), "x", max_tokens=1, stop=[rows])


def test_a_model_built_in_python_with_a_vocab_past_its_table_is_refused():
    from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config
    cfg = tiny_config()
    w = hf_weights_from_mlx_lm(random_mlx_lm_model(cfg), stacked=True)
    with pytest.raises(ValueError, match="vocab_size 1000 but the embedding table has 97 rows"):
        nemotron_h.NemotronH(nemotron_h.TargetConfig.from_dict({**cfg, "vocab_size": 1000}), w)


def test_the_smallest_context_warms_up_and_a_prompt_past_it_is_one_line(tmp_path, capsys):
    # the warm-up's own prompt once ended in an uncaught RequestError (a traceback)
    path = with_config(DEMO / "target", tmp_path / "m", max_position_embeddings=2)
    pair = md.load(str(path), verify="none", warm=True)
    assert len(md.generate(pair, [5], max_tokens=4).tokens) == 1
    assert cli.main(["generate", "--model", str(path), "--verify", "none", "-p",
                     "def f(x):"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model's context limit is 2" in err, err
