"""An mlx-lm user's habits work or point at this package's spelling (issue 25, item 2):
dtype names as strings, ``mx.array`` prompts, ``python -m mlx_dspark``, ``verbose=True``,
mlx-lm's ``load``/``generate`` call shapes and flag names, a ``--model`` that is not a
Nemotron-H target, converting twice, and MLX-written safetensors files. Demo pair, greedy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md
from mlx_dspark import cli
from mlx_dspark.converter.convert import convert
from mlx_dspark.converter.errors import ConversionError
from mlx_dspark.converter.safetensors_io import read_header

FIX = Path(__file__).parent / "fixtures"
DEMO = Path(md.__file__).parent / "demo"
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def pair():
    return md.load()


def one_line_error(capsys, argv, code=1) -> str:
    try:
        got = cli.main(argv)
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name, want", [("bfloat16", mx.bfloat16), ("float16", mx.float16),
                                        ("float32", mx.float32), ("bf16", mx.bfloat16)])
def test_load_takes_dtype_names_as_the_cli_spells_them(name, want):
    pair = md.load(dtype=name)
    assert pair.target.dtype == want and pair.drafter.dtype == want
    assert md.load_target(str(DEMO / "target"), dtype=name).dtype == want


def test_a_dtype_that_is_not_one_is_one_value_error():
    with pytest.raises(ValueError, match="dtype must be 'bfloat16', 'float16' or 'float32'"):
        md.load(dtype="int8")


def test_mx_array_prompts_one_dimensional_or_a_batch_of_one(pair):
    ids = pair.tokenizer.encode(PROMPT)
    want = md.generate(pair, ids, max_tokens=6).tokens
    assert md.generate(pair, mx.array(ids), max_tokens=6).tokens == want
    assert md.generate(pair, mx.array([ids]), max_tokens=6).tokens == want


def test_verbose_prints_the_text_and_the_stats_as_mlx_lm(pair, capsys):
    res = md.generate(pair, PROMPT, max_tokens=6, verbose=True)
    out = capsys.readouterr().out
    assert out.startswith(res.text) and "\n==========\n" in out
    assert "generation: 6 tokens" in out and "peak memory:" in out


def test_unpacking_load_like_mlx_lm_shows_the_pair_spelling(pair):
    with pytest.raises(TypeError, match=r"md.load\(\) returns one Pair, not \(model, "
                                        r"tokenizer\): write `pair = md.load"):
        model, tokenizer = pair


def test_mlx_lm_generate_call_shapes_show_ours(pair):
    with pytest.raises(TypeError, match=r"takes no tokenizer .* is md.generate\(pair, prompt\)"):
        md.generate(pair, pair.tokenizer, PROMPT, verbose=True)
    with pytest.raises(TypeError, match="the first argument is the Pair md.load"):
        md.generate(pair.target, PROMPT)
    with pytest.raises(TypeError, match=r"'temp' \(mlx-lm's temp; here: temperature=\)"):
        md.generate(pair, PROMPT, temp=0.7)
    with pytest.raises(TypeError, match=r"'draft_model' .*md.load\(model, drafter\)"):
        list(md.stream_generate(pair, PROMPT, draft_model=pair.drafter))


def test_python_dash_m_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "mlx_dspark", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"mlx-dspark {md.__version__}"


@pytest.mark.parametrize("theirs, ours", [("--draft-model", "--drafter"),
                                          ("--num-draft-tokens", "--num-draft"),
                                          ("--chat-template-config", "--chat-template-args")])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_unknown_flags_name_the_subcommand_and_our_flag(capsys, command, theirs, ours):
    err = one_line_error(capsys, [command, theirs, "x"], code=2)
    assert err.startswith(f"mlx-dspark {command}: error: unrecognized arguments: {theirs} x")
    assert f"{theirs} is {ours} here" in err
    assert ours[2:].replace("-", "_") in vars(cli.build_parser().parse_args([command]))


def test_chat_template_args_reach_the_template(pair, capsys, monkeypatch, template_calls):
    seen = template_calls(pair.tokenizer)
    monkeypatch.setattr(md.api, "load", lambda *a, **kw: pair)
    assert cli.main(["generate", "-p", "hi", "-m", "2", "--chat-template-args",
                     '{"enable_thinking": false, "x": 1}']) == 0
    assert seen and seen[-1]["enable_thinking"] is False and seen[-1]["x"] == 1
    one_line_error(capsys, ["generate", "-p", "hi", "--chat-template-args", "[1]"], code=2)


def test_our_drafter_as_model_says_pass_it_as_drafter(capsys):
    err = one_line_error(capsys, ["generate", "-p", "x", "--model", str(DEMO / "drafter")])
    assert "a DSpark drafter, not a target model; pass it as --drafter" in err


def test_another_architecture_as_model_says_nemotron_h_only(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "vocab_size": 100, "quantization": {"group_size": 64, "bits": 4}}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.zeros((2, 2))})
    err = one_line_error(capsys, ["generate", "-p", "x", "--model", str(tmp_path)])
    assert "model_type 'llama' (LlamaForCausalLM): mlx-dspark runs Nemotron-H targets only" in err


def test_converting_a_converted_directory_says_already_converted(tmp_path):
    with pytest.raises(ConversionError, match="already converted"):
        convert(str(DEMO / "target"), tmp_path / "out", progress=False)


def test_safetensors_written_by_mlx_are_read_and_converted(tmp_path):
    """MLX writes ``"__metadata__": null``; a BF16 export re-saved by MLX converts to the same
    tensors as the original."""
    src = tmp_path / "src"
    shutil.copytree(FIX / "modelopt" / "target_bf16", src)
    for f in src.glob("*.safetensors"):
        tensors = mx.load(str(f))
        f.unlink()
        mx.save_safetensors(str(f), tensors)
        assert b'"__metadata__":null' in f.read_bytes()[:200]
        assert read_header(f).keys() == tensors.keys()
    out = convert(str(src), tmp_path / "out", progress=False)
    ref = convert(str(FIX / "modelopt" / "target_bf16"), tmp_path / "ref", progress=False)
    got = {k: v for f in out.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    want = {k: v for f in ref.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
