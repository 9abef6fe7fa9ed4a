"""Shared helpers for the training scripts: token streams, batches, held-out perplexity."""
import json
import math
import os

import numpy as np
import torch

from data import WORK

SEQ_LEN = 256
# One thread: on this shared 2-core machine a second thread mostly waits at OpenMP barriers
# (measured 5x slower per step under load).
THREADS = int(os.environ.get("TRAIN_THREADS", "1"))


def tokens(split):
    """The corpus split as one token stream (cached as .npy next to the text)."""
    path = WORK / f"{split}_tokens.npy"
    if not path.exists():
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(WORK / "tokenizer" / "spm.model"))
        text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
        ids = []
        for doc in text.split("\f"):
            ids.extend(sp.encode(doc + "\f"))
        np.save(path, np.asarray(ids, dtype=np.uint16))
    return np.load(path).astype(np.int64)


def batch(stream, step, batch_size, seed, seq_len=SEQ_LEN):
    """Random windows; the generator is seeded per step so a resumed run sees the same data."""
    g = np.random.default_rng([seed, step])
    starts = g.integers(0, len(stream) - seq_len - 1, size=batch_size)
    x = np.stack([stream[s:s + seq_len + 1] for s in starts])
    return torch.from_numpy(x)


def heldout_windows(n_windows=64, seq_len=SEQ_LEN):
    """Fixed, non-overlapping held-out windows (the same ones for every measurement)."""
    stream = tokens("heldout")
    step = (len(stream) - 1) // n_windows
    return torch.from_numpy(np.stack([stream[i * step:i * step + seq_len + 1] for i in range(n_windows)]))


@torch.no_grad()
def perplexity(model, windows, batch_size=16):
    """exp(mean next-token cross-entropy) over the windows; model(ids).logits like HF."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size]
        logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    return math.exp(total / count)


def resume(ckpt, model, opt) -> int:
    """Load model and optimizer state from ``ckpt`` if it exists; return the step to go on from."""
    if not ckpt.exists():
        return 0
    ck = torch.load(ckpt)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    print(f"resumed at step {ck['step']}")
    return ck["step"]


def save_target(model, out, report: dict):
    """Held-out perplexity of a trained target, then the HF checkpoint and its report."""
    model.eval()
    ppl = perplexity(model, heldout_windows())
    print(f"held-out perplexity {ppl:.3f}")
    model.save_pretrained(out)
    (out / "training_report.json").write_text(
        json.dumps({**report, "seq_len": SEQ_LEN, "heldout_ppl": ppl}, indent=2) + "\n")
