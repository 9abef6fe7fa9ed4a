"""The Nemotron Omni / VL parent as a text target (issue 40.1): a wrapper directory in any
spelling, its text tower under ``language_model.`` beside vision, projector and audio tensors,
loads as the tower alone (the same logits as the tower saved as a plain nemotron_h checkpoint,
bit for bit), pairs with every drafter kind, gets Lightning's default drafter by its tower's
shape, converts from a ModelOpt export (the tower bit for bit, the media carried as exported),
and never reads its media weights for text; a media part sent to a model without a media path
is refused naming the part (and, without the ``omni`` extra, how to install it). The wrappers
are built with the NumPy builders (testkit/omni.py) around the demo target and the
synthetic ModelOpt export; nothing here needs the extra."""

from __future__ import annotations

import gc
import json
import shutil

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.api import DEMO
from mlx_dspark.checkpoint import memory, pairing
from mlx_dspark.checkpoint.formats import check_target_config, detect_dir
from mlx_dspark.checkpoint.hub import cache_entry
from mlx_dspark.checkpoint.recorded import verify_directory
from mlx_dspark.converter import convert
from mlx_dspark.converter.layout import RECEIPT_NAME
from mlx_dspark.media import parts
from mlx_dspark.media.parts import MediaError
from mlx_dspark.models.nemotron_h import load_target
from testkit.codecs import read_raw_checkpoint, read_raw_safetensors
from testkit.mlx_lm_layouts import dense_hf
from testkit.omni import MEDIA, wrap
from testkit.synthetic import lightning_config, synth_target
from mlx_dspark.text.tokenizer import prompt_ids
from testkit.server_helpers import app_client, started_engine

IDS = [1, 281, 1092, 44, 9, 300, 17]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The demo target as a plain Hugging Face nemotron_h directory (BF16, with its MTP)."""
    return dense_hf(DEMO / "target", tmp_path_factory.mktemp("omni") / "hf", dtype=mx.bfloat16)


@pytest.fixture(scope="module")
def omni(hf, tmp_path_factory):
    return wrap(hf, tmp_path_factory.mktemp("omni") / "omni")


def _logits(path, ids=IDS) -> mx.array:
    target = load_target(str(path), verify="none")
    return target.step(mx.array([ids]), target.make_cache())[0]


@pytest.mark.parametrize("spelling,key", [
    ("NemotronH_Nano_VL_V2", "llm_config"),
    ("NemotronH_Nano_Omni_Reasoning_V3", "text_config"),
    ("nemotronh_omni_reasoning_v3", "llm_config"),
    ("NEMOTRON_H_OMNI", "text_config")])
def test_the_wrapper_gives_its_towers_logits_bit_for_bit(hf, tmp_path, spelling, key):
    wrapper = wrap(hf, tmp_path / "omni", spelling=spelling, key=key)
    assert str(detect_dir(wrapper)) == "Hugging Face layout, bf16"
    assert mx.array_equal(_logits(wrapper), _logits(hf)).item()


def test_a_wrapper_without_a_text_config_is_refused_in_one_line(hf, tmp_path):
    wrapper = wrap(hf, tmp_path / "omni")
    cfg = json.loads((wrapper / "config.json").read_text())
    del cfg["llm_config"]
    (wrapper / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        md.load(str(wrapper), warm=False)
    assert str(e.value) == (f"{wrapper}: a Nemotron Omni wrapper (NemotronH_Nano_VL_V2) "
                            f"without its text tower's config (llm_config or text_config)")


@pytest.mark.parametrize("drafter", ["mtp", "drafter", "eagle3", "dflash"])
def test_every_drafter_kind_pairs_with_it_and_speculation_stays_exact(omni, drafter):
    pair = md.load(str(omni), drafter if drafter == "mtp" else str(DEMO / drafter),
                   warm=False)
    assert pair.drafter.gate_report.endswith("tensors match")
    spec = md.generate(pair, IDS, max_tokens=24, speculative="on")
    assert spec.stats.accepted > 0
    assert spec.tokens == md.generate(pair, IDS, max_tokens=24, speculative="off").tokens


def test_a_lightning_shaped_tower_gets_the_default_dspark_drafter():
    wrapper = {"architectures": ["NemotronH_Nano_VL_V2"], "model_type": "NemotronH_Nano_VL_V2",
               "llm_config": lightning_config(), "vision_config": {}, "sound_config": {}}
    known = pairing.known_target(check_target_config(wrapper, "omni"))
    assert known.drafter == "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DSpark"


def test_the_default_drafter_loads_for_a_wrapper_of_a_known_tower(omni, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    cfg = json.loads((DEMO / "target" / "config.json").read_text())
    shape = {k: cfg[k] for k in ("hidden_size", "vocab_size", "n_routed_experts")}
    monkeypatch.setattr(pairing, "KNOWN", [pairing.Known(
        "the demo target", "test-org/demo-dspark", {**shape, "hybrid_override_pattern": "MEM*EM"})])
    entry = cache_entry("test-org/demo-dspark")
    shutil.copytree(DEMO / "drafter", entry)
    receipt = json.loads((entry / RECEIPT_NAME).read_text())
    receipt["source"]["repo_id"] = "test-org/demo-dspark"
    (entry / RECEIPT_NAME).write_text(json.dumps(receipt))
    pair = md.load(str(omni), "auto", warm=False)
    assert pair.drafter.label == "DSpark" and "the default for the demo target" in \
        pair.drafter_note


def test_the_cli_generates_and_verifies_with_it(omni, capsys):
    assert cli.main(["generate", "--model", str(omni), "--drafter", "mtp", "-p", "def f(x):",
                     "-m", "8", "--speculative", "on"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "Traceback" not in out.err and "model of type" not in out.err
    assert cli.main(["verify", str(omni)]) == 0
    assert "intact" in capsys.readouterr().out


def test_the_recorded_hashes_cover_its_media_tensors(hf, tmp_path):
    wrapper = wrap(hf, tmp_path / "omni")
    md.load(str(wrapper), "none", warm=False)           # its first load records its hashes
    f = wrapper / "model.safetensors"
    data = bytearray(f.read_bytes())
    name = "mlp1.1.weight"
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    start = 8 + int.from_bytes(data[:8], "little") + header[name]["data_offsets"][0]
    data[start] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors"):
        verify_directory(str(wrapper))


@pytest.mark.parametrize("algo", ["NVFP4", "MIXED_PRECISION"])
def test_convert_takes_a_modelopt_export_of_the_wrapper(tmp_path, algo):
    synth_target(tmp_path / "src", algo, shards=2)
    wrap(tmp_path / "src", tmp_path / "omni", spelling="NemotronH_Omni_Reasoning_V3")
    plain = convert(tmp_path / "src", tmp_path / "plain", progress=False)
    out = convert(tmp_path / "omni", tmp_path / "omni-mlx", progress=False)
    tower = {}
    for f in sorted(out.glob("model*.safetensors")):
        tower.update(read_raw_safetensors(f))
    assert tower == read_raw_checkpoint(plain)                   # the text tower, bit for bit
    media = read_raw_safetensors(out / "media.safetensors")
    source = read_raw_checkpoint(tmp_path / "omni")
    assert sorted(media) == sorted(MEDIA) and all(media[n] == source[n] for n in media)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronH_Omni_Reasoning_V3"]
    assert cfg["quantization"]["layout"] == "mlx-dspark/1" and "vision_config" in cfg
    assert "media.safetensors" in json.loads((out / RECEIPT_NAME).read_text())["outputs"]
    assert cli.main(["verify", str(out)]) == 0
    ids = [1, 28, 10, 44, 7]                                    # the synthetic vocabulary's
    assert mx.array_equal(_logits(out, ids), _logits(plain, ids)).item()
    assert md.load_drafter("mtp", load_target(str(out))).gate_report.endswith("tensors match")
    spoilt = bytearray((out / "media.safetensors").read_bytes())
    spoilt[-1] ^= 1
    (out / "media.safetensors").write_bytes(bytes(spoilt))
    assert cli.main(["verify", str(out)]) != 0                   # the receipt covers the media


def test_media_weights_are_neither_read_nor_counted_for_text(hf, tmp_path):
    big = {**MEDIA, "vision_model.radio_model.model.blocks.1.mlp.fc1.weight": (4096, 2048)}
    wrapper = wrap(hf, tmp_path / "omni", media=big)              # 16 MB of vision weights
    assert memory.weight_bytes(wrapper, mx.float32) == memory.weight_bytes(hf, mx.float32)
    assert memory.needed_bytes(wrapper, "mtp") == memory.needed_bytes(hf, "mtp")
    peaks = []
    for path in (hf, wrapper):
        gc.collect()
        mx.clear_cache()
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        target = load_target(str(path), verify="none")
        peaks.append(mx.get_peak_memory() - start)
        del target
    assert peaks[1] - peaks[0] < (8 << 20)       # the 16 MB were never read (MLX's peak
    #                                              counts other threads too: a few MB of noise)


def test_the_server_answers_from_it(omni):
    for running in started_engine(lambda: md.load(str(omni), "mtp", warm=False)):
        client = app_client(running, "omni")
        r = client.post("/v1/chat/completions", json={
            "model": "omni", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "def f(x):"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_a_media_part_to_a_model_without_a_media_path_is_refused_naming_it(monkeypatch):
    pair = md.load(str(DEMO / "target"), "none", warm=False)
    messages = [{"role": "system", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "see"},
                                             {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(MediaError) as e:
        prompt_ids(pair.tokenizer, messages, True)
    assert e.value.param == "messages[1].content[1]"
    monkeypatch.setattr(parts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MediaError, match=r"^messages\[1\]\.content\[1\]: images and audio need "
                                         r"the omni extra: pip install 'mlx-dspark\[omni\]'"):
        prompt_ids(pair.tokenizer, messages, True)
