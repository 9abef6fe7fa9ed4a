"""A converted target + drafter pair for the command-line tests, made the way a user makes one.

The sources are the committed ModelOpt exports (tests/fixtures/modelopt: a tiny Nemotron-H
exported as W4A16_NVFP4 and a DSpark drafter in NVIDIA's layout that taps its layers); a small
character-level BPE tokenizer with a chat template is added to the target's source directory,
then both go through the real ``mlx_dspark.converter.convert``. The weights are random, so the
text is gibberish and the drafter is useless: these tests check the commands, not the model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "modelopt"
VOCAB = 256          # the fixture target's vocab_size
MASK_ID = 250        # the fixture drafter's mask_token_id: reserved, no text encodes to it
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
# Like the demo pair's template, plus the ``enable_thinking`` switch reasoning models take.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% else %}<|assistant|>\n{{ message['content'] }}</s>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
# Training text for the BPE merges: a little English and a little Python.
CORPUS = """The quick brown fox jumps over the lazy dog. What is the capital of France?
Paris is the capital and most populous city of France. Tell me a story about a robot.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
Compute 12 * 7 + 3 = 87. Solve for x: 2x + 5 = 17, so x = 6.
"""


def write_tokenizer(out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, eos) covering ids 0..VOCAB-1."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()     # tokens are raw substrings: decoding concatenates them
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=MASK_ID, special_tokens=SPECIALS, initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False))
    assert tok.get_vocab_size() == MASK_ID, tok.get_vocab_size()
    # The mask and a few unused ids fill the vocabulary up, so every id a model emits decodes.
    extra = ["<mask>"] + [f"<unused{i}>" for i in range(VOCAB - MASK_ID - 1)]
    tok.add_special_tokens(extra)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", mask_token="<mask>", additional_special_tokens=SPECIALS[4:],
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    assert fast.convert_tokens_to_ids("<mask>") == MASK_ID


def make_pair(root: Path, target: str = "target_w4a16", drafters: bool = False):
    """Convert the fixture exports into ``root``; returns (target_dir, drafter_dir), and with
    ``drafters`` also an EAGLE-3 head's dir, the target then carrying an MTP block (both
    random, synthetic: testkit.synthetic)."""
    from mlx_dspark.converter import convert
    from testkit.synthetic import add_mtp_block, synth_eagle3

    src = root / "src"
    shutil.copytree(FIXTURES / target, src)
    write_tokenizer(src)
    if drafters:
        add_mtp_block(src)
    convert(str(src), root / "target", progress=False)
    convert(str(FIXTURES / "drafter_nvfp4"), root / "drafter", progress=False)
    shutil.rmtree(src)
    if not drafters:
        return root / "target", root / "drafter"
    synth_eagle3(root / "eagle3-src", vocab=VOCAB, aux=(2, 4, 8))
    convert(str(root / "eagle3-src"), root / "eagle3", progress=False)
    shutil.rmtree(root / "eagle3-src")
    return root / "target", root / "drafter", root / "eagle3"


if __name__ == "__main__":   # python tests/cli_pair.py DIR: a pair to try the commands on
    import sys

    t, d = make_pair(Path(sys.argv[1]))
    print(f"mlx-dspark chat --model {t} --drafter {d}")
