"""Honest detection (issue 31): each model mlx-dspark cannot run is refused in one line naming
its format and what to use instead; ``convert`` on an MLX-layout input says it loads as it is
and writes nothing, and never reports success for output that would not load; a repo id is
judged by its small files (config.json, the safetensors index) before any large download, and
one in mlx-lm's layout is downloaded and loaded as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint.formats import UnsupportedFormat, detect_dir
from mlx_dspark.checkpoint.integrity import CheckpointError
from mlx_dspark.checkpoint.memory import InsufficientMemory
from mlx_dspark.converter import convert, hub
from mlx_dspark.converter.errors import ConversionError
from testkit.mlx_lm_layouts import dense_hf, mlx_lm_convert, with_config
from testkit.omni import wrap

FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    hf = dense_hf(DEMO / "target", root / "hf", dtype=mx.bfloat16)
    return {"hf": hf, "bf16": mlx_lm_convert(hf, root / "bf16", dtype="bfloat16"),
            "4bit": mlx_lm_convert(hf, root / "4bit", quantize=True, q_bits=4)}


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------- local refusals


def test_a_gguf_directory_or_file_is_named_and_pointed_elsewhere(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(UnsupportedFormat) as e:
        md.load(str(tmp_path / "m"))
    assert "GGUF files (llama.cpp's format)" in one_line(e) and "safetensors" in str(e.value)
    with pytest.raises(FileNotFoundError, match="a GGUF file .llama.cpp's format., not a model "
                                                "directory"):
        md.load(str(tmp_path / "m" / "model-Q4_K_M.gguf"))


def test_pytorch_pickles_are_refused_by_name(tmp_path):
    shutil.copy(DEMO / "target" / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UnsupportedFormat, match=r"PyTorch pickles .*never unpickles"):
        md.load_target(str(tmp_path))


@pytest.mark.parametrize("method, name", [("gptq", "GPTQ"), ("awq", "AWQ"),
                                          ("bitsandbytes", "bitsandbytes")])
def test_other_quantization_methods_are_refused_naming_them(dirs, tmp_path, method, name):
    bad = with_config(dirs["hf"], tmp_path / method, quantization_config={"quant_method": method})
    with pytest.raises(UnsupportedFormat) as e:
        md.load(str(bad))
    assert one_line(e).startswith(f"{bad}: {name} quantization") and "mlx_lm.convert" in str(e.value)


def test_an_unconverted_modelopt_export_offers_convert_in_one_line():
    src = FIXTURES / "target_w4a16"
    for load in (md.load, md.load_target):
        with pytest.raises(ValueError) as e:
            load(str(src))
        assert f"`mlx-dspark convert {src} -o {src}-mlx`" in one_line(e)


def test_a_latent_moe_config_over_full_width_experts_is_refused(dirs, tmp_path):
    """mlx-lm's layout with a latent MoE loads (tests/test_latent_moe.py); one whose config
    says latent over experts at full width is refused, naming config.json and the field."""
    bad = with_config(dirs["4bit"], tmp_path / "latent", moe_latent_size=64)
    with pytest.raises(CheckpointError) as e:
        md.load_target(str(bad))
    assert one_line(e).startswith(f"{bad / 'config.json'}: moe_latent_size 64, but the MoE "
                                  f"layers have no fc1_latent_proj")


def test_other_architectures_and_drafters_given_as_the_model(tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama",
                                                   "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="other models run with mlx-lm"):
        md.load(str(llama))
    with pytest.raises(ValueError, match="an EAGLE-3 head, not a target model; pass it as "
                                         "--drafter"):
        md.load(str(DEMO / "eagle3"))
    with pytest.raises(ValueError, match="a DSpark drafter, not a target model"):
        md.load(str(DEMO / "drafter"))


def test_the_cli_says_each_refusal_in_one_line(dirs, tmp_path, capsys):
    bad = with_config(dirs["hf"], tmp_path / "gptq", quantization_config={"quant_method": "gptq"})
    assert cli.main(["generate", "--model", str(bad), "-p", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlx-dspark generate: error: ") and "GPTQ" in err


def test_formats_are_told_apart(dirs):
    assert str(detect_dir(dirs["hf"])) == "Hugging Face layout, bf16"
    assert str(detect_dir(dirs["bf16"])) == "mlx-lm's layout, bf16"
    assert str(detect_dir(dirs["4bit"])) == "mlx-lm's layout, affine 4-bit (group 64)"
    assert str(detect_dir(DEMO / "target")) == "mlx-dspark's converted layout, W4A16_NVFP4"
    assert detect_dir(FIXTURES / "target_w4a16").layout == "modelopt"


# ------------------------------------------------------------------------- convert, honestly


@pytest.mark.parametrize("which", ["bf16", "4bit"])
def test_convert_says_an_mlx_layout_input_loads_as_it_is_and_writes_nothing(dirs, tmp_path,
                                                                            capsys, which):
    out = tmp_path / "out"
    assert cli.main(["convert", str(dirs[which]), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already in MLX layout (mlx-lm's layout" in err
    assert "it loads as it is" in err and not out.exists()
    md.load_target(str(dirs[which]))            # and it does


def test_convert_never_reports_success_for_a_target_that_would_not_load(dirs, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(dirs["hf"], src)
    w = mx.load(str(src / "model.safetensors"))
    del w["backbone.layers.2.mixer.dt_bias"]
    mx.save_safetensors(str(src / "model.safetensors"), w)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="tensor backbone.layers.2.mixer.dt_bias missing; "
                                              "nothing written"):
        convert(str(src), out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert "converted" not in capsys.readouterr().err


def test_convert_of_the_unconverted_hf_directory_loads(dirs, tmp_path):
    out = convert(str(dirs["hf"]), tmp_path / "out", progress=False)
    assert md.load_target(str(out)).format.layout == "mlx-dspark"


# ------------------------------------------------------------------------- repo ids


@pytest.fixture
def fake_hub(dirs, tmp_path, monkeypatch):
    """Repos served from local directories; records every file asked for, in order."""
    repos, asked = {}, []
    gptq = with_config(dirs["hf"], tmp_path / "gptq", quantization_config={"quant_method": "gptq"})
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "model.gguf").write_bytes(b"GGUF")
    repos.update({"mlx-community/demo-4bit": dirs["4bit"], "mlx-community/demo-bf16": dirs["bf16"],
                  "someone/demo-gptq": gptq, "someone/demo-gguf": gguf,
                  "someone/demo-omni": wrap(dirs["hf"], tmp_path / "omni")})

    def small_file(repo_id, name, revision, required=False, offline=False):
        asked.append((repo_id, name))
        f = repos[repo_id] / name
        return f if f.is_file() else None

    def snapshot(repo_id, revision):
        asked.append((repo_id, "*"))
        return str(repos[repo_id])

    monkeypatch.setattr(hub, "_reachable", lambda repo_id, revision: True)
    monkeypatch.setattr(hub, "_small_file", small_file)
    monkeypatch.setattr(hub, "_snapshot_download", snapshot)
    monkeypatch.setattr(hub, "cached_snapshot", lambda repo_id, revision: None)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    return repos, asked


def test_an_mlx_lm_repo_is_judged_by_its_small_files_then_loads_as_it_is(fake_hub, tmp_path,
                                                                          capsys):
    repos, asked = fake_hub
    pair = md.load("mlx-community/demo-4bit", str(DEMO / "drafter"), dtype="float32", warm=False)
    repo = "mlx-community/demo-4bit"
    assert asked[0] == (repo, "config.json") and asked[-1] == (repo, "*")
    assert (repo, "model.safetensors.index.json") in asked[:-1]
    assert pair.path == repos[repo] and str(pair.target.format).startswith("mlx-lm's layout")
    assert not (tmp_path / "cache" / "mlx-community--demo-4bit--main").exists()   # not converted
    err = capsys.readouterr().err
    assert "GB of weights: downloading it (it loads as it is)" in err
    ids = [1, 281, 1092, 44]
    assert md.generate(pair, ids, max_tokens=12, speculative="on").tokens == \
        md.generate(pair, ids, max_tokens=12, speculative="off").tokens


def test_an_omni_parents_repo_is_judged_by_its_text_tower_and_converted(fake_hub, dirs):
    pair = md.load("someone/demo-omni", "mtp", warm=False)
    assert pair.path.name == "someone--demo-omni--main"            # converted into the cache
    assert (pair.path / "media.safetensors").is_file()
    plain = md.load(str(dirs["hf"]), "mtp", warm=False)
    ids = [1, 281, 1092, 44]
    assert md.generate(pair, ids, max_tokens=12, speculative="on").tokens == \
        md.generate(plain, ids, max_tokens=12, speculative="off").tokens


@pytest.mark.parametrize("repo, words", [
    ("someone/demo-gptq", "GPTQ quantization"),
    ("someone/demo-gguf", "no config.json, so not a Hugging Face checkpoint in safetensors"),
])
def test_a_repo_that_cannot_run_is_refused_before_any_large_download(fake_hub, repo, words):
    _, asked = fake_hub
    with pytest.raises((ValueError, ConversionError)) as e:
        md.load(repo)
    assert words in one_line(e)
    assert (repo, "*") not in asked and all(name != "*" for _, name in asked)


def test_a_repo_too_large_for_the_device_is_refused_before_its_download(fake_hub, monkeypatch):
    from mlx_dspark.checkpoint import memory
    _, asked = fake_hub
    monkeypatch.setattr(memory, "available_memory", lambda: (1000, "available RAM"))
    with pytest.raises(InsufficientMemory, match="its weights alone are .* so nothing was "
                                                 "downloaded"):
        md.load("mlx-community/demo-bf16")
    assert all(name != "*" for _, name in asked)


def test_convert_of_an_mlx_lm_repo_downloads_nothing(fake_hub, tmp_path):
    _, asked = fake_hub
    with pytest.raises(ConversionError, match="already in MLX layout .* nothing downloaded"):
        convert("mlx-community/demo-bf16", tmp_path / "out", progress=False)
    assert all(name != "*" for _, name in asked)
