"""The embedded demonstration pair (mlx_dspark/demo/): a small Nemotron-H-shaped target and a
DSpark drafter built by training/ and converted by `mlx-dspark convert`. Not Nemotron."""
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark as md

DEMO = Path(md.__file__).parent / "demo"
PROMPTS = json.loads((Path(__file__).parents[1] / "training" / "prompts.json").read_text())


@pytest.fixture(scope="module")
def pair32():
    return md.load(dtype=mx.float32)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_pair_loads_with_no_arguments_and_is_labelled_a_demonstration():
    pair = md.load()
    assert pair.drafter is not None and pair.tokenizer is not None
    for kind in ("target", "drafter", "eagle3", "dflash"):
        label = json.loads((DEMO / kind / "config.json").read_text())["mlx_dspark_demo"]
        assert "demonstration model, not Nemotron" in label
    assert "not Nemotron" in (DEMO / "README.md").read_text()


@pytest.mark.parametrize("kind", ["target", "drafter", "eagle3", "dflash"])
def test_demo_receipt_lists_exactly_the_shipped_files_with_their_hashes(kind):
    folder = DEMO / kind
    outputs = json.loads((folder / "MERERUN_CONVERSION.json").read_text())["outputs"]
    shipped = {p.name for p in folder.iterdir() if p.name != "MERERUN_CONVERSION.json"}
    assert set(outputs) == shipped
    for name, entry in outputs.items():
        assert (folder / name).stat().st_size == entry["size"], name
        assert sha256(folder / name) == entry["sha256"], name


def test_demo_drafter_passes_the_weight_load_gate_on_every_tensor(pair32):
    matched, total = pair32.drafter.gate_report.split()[0].split("/")
    assert int(total) > 0 and matched == total


@pytest.mark.parametrize("prompt", PROMPTS["code"][:3] + PROMPTS["text"][:1])
def test_greedy_speculative_output_equals_serial_on_heldout_prompts(pair32, prompt):
    serial = md.generate(pair32, prompt, max_tokens=40, speculative=False)
    spec = md.generate(pair32, prompt, max_tokens=40, speculative=True)
    assert spec.tokens == serial.tokens
    assert spec.stats["rounds"] > 0


def test_demo_drafter_is_accepted_often_on_code(pair32):
    # Far below the measured numbers (training/README.md); an untrained or mis-loaded drafter
    # accepts almost nothing.
    spec = md.generate(pair32, PROMPTS["code"][0], max_tokens=48, speculative=True)
    assert spec.stats["acceptance_by_position"][0] > 0.4


def test_code_prompt_continues_with_varied_python_looking_tokens():
    pair = md.load()
    res = md.generate(pair, "def fibonacci(n):", max_tokens=48, speculative=False)
    assert len(res.tokens) == 48
    assert len(set(res.tokens)) >= 10, res.text
    assert "\n" in res.text and "    " in res.text, res.text


def distinct_4grams(tokens) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams)


def wordlike(text: str) -> float:
    return sum(c.isalnum() or c.isspace() for c in text) / len(text)


@pytest.mark.parametrize("prompt", PROMPTS["chat"][:4])
def test_a_heldout_chat_prompt_gets_a_python_answer_not_symbol_runs(prompt):
    # Issue 33: through the chat template (what `generate -p` and `chat` send), the first
    # demo target answered every request with runs like `<>\n\n<>... =^=^=^` (distinct 4-grams
    # 0.11, letters/digits/whitespace 0.05). The bar: 0.5 and 0.6 in 128 greedy tokens.
    res = md.generate(md.load(), prompt, max_tokens=128, chat=True)
    assert distinct_4grams(res.tokens) >= 0.5, res.text
    assert wordlike(res.text) >= 0.6, res.text
    assert "def " in res.text or "class " in res.text, res.text


@pytest.fixture(scope="module", params=["mtp", "eagle3", "dflash"])
def other32(request):
    return request.param, md.load(drafter=request.param, dtype=mx.float32)


def test_the_demo_mtp_eagle3_and_dflash_drafters_are_gated(other32):
    from mlx_dspark.drafters.dflash import DFlashDrafter
    from mlx_dspark.drafters.eagle3 import Eagle3Drafter
    from mlx_dspark.drafters.mtp import MTPDrafter
    name, pair = other32
    assert isinstance(pair.drafter, {"mtp": MTPDrafter, "eagle3": Eagle3Drafter,
                                     "dflash": DFlashDrafter}[name])
    matched, total = pair.drafter.gate_report.split()[0].split("/")
    assert int(total) > 10 and matched == total


@pytest.mark.parametrize("prompt", PROMPTS["code"][:2] + PROMPTS["text"][:1])
def test_greedy_with_the_demo_mtp_eagle3_and_dflash_drafters_equals_serial(other32, prompt):
    pair = other32[1]
    serial = md.generate(pair, prompt, max_tokens=32, speculative=False)
    spec = md.generate(pair, prompt, max_tokens=32, speculative=True, num_draft=3)
    assert spec.tokens == serial.tokens and spec.stats["rounds"] > 0


def test_the_demo_mtp_eagle3_and_dflash_drafters_are_accepted_often_on_code(other32):
    # Far below the measured numbers (training/README.md, steps 8 to 10); untrained, each
    # agrees with the target's greedy token on under 4% of held-out rows.
    spec = md.generate(other32[1], PROMPTS["code"][0], max_tokens=48, speculative=True,
                       num_draft=1)
    assert spec.stats["acceptance_by_position"][0] > 0.25


def test_the_demo_mtp_eagle3_and_dflash_drafters_draft_under_a_grammar(other32):
    pair = other32[1]
    ask = dict(max_tokens=24, response_format={"type": "json_object"}, chat=True)
    spec = md.generate(pair, "Give me a JSON object with a key x.", speculative=True, **ask)
    serial = md.generate(pair, "Give me a JSON object with a key x.", speculative=False, **ask)
    assert spec.tokens == serial.tokens and spec.stats.rounds > 0 and spec.text.startswith("{")
