"""Step 2: a sentencepiece tokenizer for code, exported in Hugging Face format.

BPE with byte fallback (any byte round-trips), no normalization, no dummy prefix and
whitespace-only pieces allowed, so indentation and newlines survive exactly. The export is a
`tokenizer.json` made by transformers' own sentencepiece converter plus a
`tokenizer_config.json` with bos/eos and a small chat template, so AutoTokenizer and mlx-lm's
tokenizer wrapper load it without sentencepiece.

    /work/venv-fx/bin/python training/tokenizer.py    # writes training/work/tokenizer/
"""
import json
import shutil

import sentencepiece as spm

from data import WORK
from shapes import VOCAB

SEED = 1234
TOK_DIR = WORK / "tokenizer"
# Pad, bos, eos and unk first (ids 0-3), then the drafter's mask token: a reserved id no text
# ever produces, like NVIDIA's mask_token_id.
SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
MASK = "<mask>"
CHAT_TURN = ["<|user|>", "<|assistant|>"]
# The template the tokenizer was first exported with; the shipped demo pair's was replaced
# after conversion by a Nemotron-format one (step 6a, training/amend_template.py).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% else %}<|assistant|>\n{{ message['content'] }}</s>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_spm():
    TOK_DIR.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(SEED)
    spm.SentencePieceTrainer.train(
        input=str(WORK / "train.txt"),
        model_prefix=str(TOK_DIR / "spm"),
        model_type="bpe",
        vocab_size=VOCAB,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n", "\f", MASK] + CHAT_TURN,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        pad_piece=SPECIALS["pad"], bos_piece=SPECIALS["bos"], eos_piece=SPECIALS["eos"],
        unk_piece=SPECIALS["unk"],
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=1_000_000,
        max_sentence_length=1 << 16,
        num_threads=2,
    )


def export_hf():
    """tokenizer.json from transformers' converter, which follows the sentencepiece model's own
    normalizer settings (here: none), so it encodes exactly like SentencePieceProcessor."""
    from sentencepiece import sentencepiece_model_pb2
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((TOK_DIR / "spm.model").read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIALS["bos"], eos_token=SPECIALS["eos"], unk_token=SPECIALS["unk"],
        pad_token=SPECIALS["pad"], mask_token=MASK, additional_special_tokens=CHAT_TURN,
        add_bos_token=False, add_eos_token=False,
        clean_up_tokenization_spaces=False, model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    out = TOK_DIR / "hf"
    shutil.rmtree(out, ignore_errors=True)
    tok.save_pretrained(out)
    return out


def check_round_trip(hf_dir, text):
    """The HF tokenizer must encode like sentencepiece and decode code back byte for byte."""
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(TOK_DIR / "spm.model"))
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text), "HF tokenizer and sentencepiece disagree"
    assert tok.decode(ids) == text, "round trip changed the text"
    return len(ids)


if __name__ == "__main__":
    train_spm()
    hf = export_hf()
    sample = (WORK / "heldout.txt").read_text(encoding="utf-8")[:200_000]
    n = check_round_trip(hf, sample)
    print(f"round trip ok: {len(sample)} chars -> {n} tokens ({len(sample)/n:.2f} chars/token)")
