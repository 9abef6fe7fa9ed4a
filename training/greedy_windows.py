"""Windows of the shipped target's own greedy text, made by the MLX runtime.

Greedy speculation drafts against exactly this text (the target's greedy output, not the
corpus), so the drafters train on it, as DSpark/DFlash and EAGLE-3 drafters train on
target-regenerated data:

* ``corpus``: a GEN_PREFIX-token corpus prefix, then the target's greedy continuation;
* ``chat``: a chat task's prompt (chat_data.py, rendered by the chat template), then the
  target's greedy answer; when the answer ends (eos), the next task's prompt follows, as the
  next turn of a `chat` session would, until the window is full;
* ``text``: the first few words of an English comment line of the split (``# Return the
  ...``), then the target's greedy continuation: what a short prose prompt (measure_pair's
  text kind) makes this code model write.

Cached as .npy in training/work/, keyed by the converted target's weight hash, so a new target
regenerates them. Runtime's Python (with the `train` extra for the chat template):

    .venv-train/bin/python training/greedy_windows.py     # builds the default sets
"""
import re

import numpy as np

import chat_data
from common import SEQ_LEN, tokens
from data import WORK, file_key

GEN_PREFIX = 96


def target_key() -> str:
    return file_key(chat_data.DEMO / "model.safetensors")


def _pair():
    import mlx_dspark as md

    return md, md.load(drafter=None)


def corpus_window(md, pair, stream, start):
    ids = stream[start:start + GEN_PREFIX].tolist()
    out = md.generate(pair, ids, max_tokens=SEQ_LEN - GEN_PREFIX, speculative=False)
    ids += out.tokens
    return ids if len(ids) == SEQ_LEN else None   # ended at eos early: drawn again


def text_prefixes(split: str) -> list:
    """Openings of the split's comment lines that read as prose: a capitalized word, then at
    least three lower-case ones (deduplicated, sorted: the draw is seeded)."""
    text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"^[ \t]*# ([A-Z][a-z]+(?: [a-z]+){3,})", text, re.M)))


def text_window(md, pair, prefix):
    from mlx_dspark.text.tokenizer import prompt_ids

    ids = prompt_ids(pair.tokenizer, prefix)   # as generate encodes a str prompt
    ids += md.generate(pair, ids, max_tokens=SEQ_LEN - len(ids), speculative=False).tokens
    return ids if len(ids) == SEQ_LEN else None   # ended at eos early: drawn again


def chat_window(md, pair, split, first):
    eos = chat_data.tokenizer().eos_token_id
    ids, i = [], first
    while len(ids) < SEQ_LEN:
        ids += chat_data.example(split, i)[0]
        i += 1
        ids += md.generate(pair, ids, max_tokens=SEQ_LEN, speculative=False).tokens[:SEQ_LEN] + [eos]
    return ids[:SEQ_LEN]


def windows(kind: str, n: int, split: str = "train", seed: int = 0) -> np.ndarray:
    """[n, SEQ_LEN] token ids of ``kind`` (``corpus``, ``chat`` or ``text``), cached."""
    path = WORK / f"greedy_{kind}_{split}_{n}_{seed}_{target_key()}.npy"
    if path.exists():
        return np.load(path).astype(np.int64)
    md, pair = _pair()
    rows = []
    if kind == "corpus":
        stream = tokens(split)
        g = np.random.default_rng([seed, 77])
        while len(rows) < n:
            row = corpus_window(md, pair, stream, int(g.integers(0, len(stream) - SEQ_LEN)))
            if row is not None:
                rows.append(row)
    elif kind == "text":
        prefixes, g = text_prefixes(split), np.random.default_rng([seed, 78])
        while len(rows) < n:
            words = prefixes[int(g.integers(len(prefixes)))].split()
            row = text_window(md, pair, " ".join(words[:int(g.integers(2, 5))]))
            if row is not None:
                rows.append(row)
    else:
        for r in range(n):
            rows.append(chat_window(md, pair, split, 10**7 + (seed * n + r) * 8))
    out = np.asarray(rows, dtype=np.int64)
    np.save(path, out.astype(np.uint16))
    print(f"{path.name}: {n} windows", flush=True)
    return out


if __name__ == "__main__":
    import time

    t0 = time.time()
    windows("chat", 4)
    print(f"{time.time() - t0:.1f} s")
