"""DSpark and DFlash drafters saved in vllm-project/speculators' convention (issue 40.4): their
block slots and tap layers are offset from NVIDIA's layout, and read as it their acceptance
collapses to about one token per round with no error (sglang#30261). Such a config.json is
refused by name, in one line naming the file and the convention, by every way in: the drafter
loader (even when the config also names NVIDIA's architecture and would otherwise load), each
kind's config parser, ``mlx-dspark convert`` and the CLI; nothing is written."""

from __future__ import annotations

import json
import shutil

import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.api import DEMO
from mlx_dspark.converter import convert
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.drafters import dflash
from mlx_dspark.drafters.base import DrafterError
from mlx_dspark.drafters.config import parse_config
from testkit.synthetic import synth_drafter

# What vllm-project/speculators writes for a DSpark head (its DSparkSpeculatorConfig): the
# drafter's own layer config nested, the taps as aux_hidden_state_layer_ids (layers done).
SPECULATORS = {
    "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
    "speculators_config": {"algorithm": "dspark", "proposal_methods": [
        {"proposal_type": "greedy", "speculative_tokens": 8}],
        "verifier": {"architectures": ["NemotronHForCausalLM"]}},
    "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 192,
                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 48,
                                 "intermediate_size": 512, "vocab_size": 4096},
    "aux_hidden_state_layer_ids": [2, 4, 6], "block_size": 8, "mask_token_id": 6,
    "draft_vocab_size": 4096, "markov_rank": 64, "markov_head_type": "vanilla",
    "enable_confidence_head": False, "sample_from_anchor": True,
}
CONVENTION = "drafter in the vllm-project/speculators convention (speculators_model_type"


@pytest.fixture(scope="module")
def target():
    return md.load_target(str(DEMO / "target"), dtype="float32")


def one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def _demo_drafter(tmp_path, name, **fields):
    """The demo DSpark drafter with ``fields`` set in its config.json (None: removed)."""
    out = tmp_path / name
    shutil.copytree(DEMO / "drafter", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_speculators_config_is_refused_by_name(tmp_path, target):
    path = tmp_path / "speculators"
    shutil.copytree(DEMO / "drafter", path)
    (path / "config.json").write_text(json.dumps(SPECULATORS))
    with pytest.raises(DrafterError) as e:
        md.load_drafter(str(path), target, verify="none")
    line = one_line(e)
    assert line.startswith(f"{path / 'config.json'}: a dspark {CONVENTION} 'dspark')")
    assert "anchor-first (sample_from_anchor true: slot j predicts anchor+j+1" in line
    assert "aux_hidden_state_layer_ids count layers done" in line and "sglang#30261" in line


def test_one_that_also_names_nvidia_s_architecture_is_never_loaded(tmp_path, target):
    """NVIDIA's fields and architecture, plus speculators' marks, its slots unstated (an older
    export, or a config rewritten by a serving stack): without the check it loads silently."""
    path = _demo_drafter(tmp_path, "rewritten", speculators_model_type="dspark",
                         aux_hidden_state_layer_ids=[2, 4, 6], sample_from_anchor=None)
    with pytest.raises(DrafterError) as e:
        md.load_drafter(str(path), target, verify="none")
    assert one_line(e).startswith(f"{path / 'config.json'}: a dspark {CONVENTION}")
    assert "of unstated slots (no sample_from_anchor" in str(e.value)
    with pytest.raises(DrafterError):
        md.load(str(DEMO / "target"), str(path), verify="none", warm=False)
    assert md.load_drafter(str(DEMO / "drafter"), target).gate_report.endswith("tensors match")


def test_each_block_kind_s_parser_refuses_it_too():
    where = "drafter/config.json"
    for parse, cfg in ((parse_config, dict(SPECULATORS, architectures=["Qwen3DSparkModel"])),
                       (dflash.parse_config, {"architectures": ["DFlashDraftModel"],
                                              "speculators_config": {"algorithm": "dflash"},
                                              "sample_from_anchor": False})):
        with pytest.raises(DrafterError) as e:
            parse(cfg, where)
        assert one_line(e).startswith(f"{where}: a ") and "speculators convention" in str(e.value)
    with pytest.raises(DrafterError, match=r"its block is 1\+N \(sample_from_anchor false\)"):
        dflash.parse_config({"architectures": ["DFlashDraftModel"],
                             "speculators_model_type": "dflash", "sample_from_anchor": False},
                            where)


def test_convert_refuses_it_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "export"

    def speculators(tensors, config, quant):
        config.update(speculators_model_type="dspark", aux_hidden_state_layer_ids=[2, 4],
                      sample_from_anchor=True)
    synth_drafter(src, edit=speculators)
    with pytest.raises(ConversionError) as e:
        convert(str(src), tmp_path / "out", progress=False)
    assert one_line(e).startswith(f"{src / 'config.json'}: a dspark {CONVENTION}")
    assert not (tmp_path / "out").exists()
    assert cli.main(["convert", str(src), "-o", str(tmp_path / "cli")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{src / 'config.json'}: a dspark {CONVENTION}" in err
    assert not (tmp_path / "cli").exists()


def test_other_drafters_and_eagle3_are_not_taken_for_it(tmp_path):
    """Only the block kinds' speculators types are refused; NVIDIA's configs (which carry
    sample_from_anchor false) and an EAGLE-3 speculators type go on as before."""
    from mlx_dspark.converter.layout import speculators_refusal
    nvidia = json.loads((DEMO / "drafter" / "config.json").read_text())
    assert speculators_refusal(nvidia, "c") is None
    assert speculators_refusal({"speculators_model_type": "eagle3"}, "c") is None
