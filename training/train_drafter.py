"""Step 5: train the DSpark drafter against the frozen, exported (NVFP4-dequantized) target.

The target is the exported checkpoint dequantized by ModelOpt (export_target.load_dequantized),
i.e. exactly the weights the runtime verifies with. Its taps (pre-final-norm residuals after
TARGET_LAYER_IDS) are computed once for a fixed set of training windows and cached; the target
distribution at every position is norm_f + lm_head of the last tap (the last tap is the last
layer's output), so it needs no second pass.

Training data: one window of every batch of four is corpus text, three are windows whose tail is
the target's own greedy continuation of a corpus prefix (generated_windows).

Objective (DSpark, design.md §11): for each anchor P (bonus = true token at P, context = taps of
positions < P) and block position k = 1..N_TRAIN:
    w_k * (0.1 * CE(z_k, x_{P+k}) + 0.9 * TV(softmax(z_k), softmax(target logits at P+k-1)))
with w_k = exp(-(k-1)/4), z_k including the Markov bias (prev = the true token at P+k-1).
Embedding and lm_head are the target's, frozen.

    /work/venv-fx/bin/python training/train_drafter.py [--steps N]
"""
import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import SEQ_LEN, THREADS, resume, tokens
from data import WORK, file_key
from drafter_io import target_taps
from drafter_model import DrafterConfig, DSparkDrafter, block_mask
from export_target import load_dequantized
from shapes import TARGET_LAYER_IDS
from tokenizer import MASK

SEED = 4321
N_TRAIN = 3            # block positions trained: N = 3 is the main use (see README)
ANCHORS = 64           # anchors per window per step
BATCH = 4              # windows per step
CORPUS_ROWS = 1        # of which corpus text; the rest the target's own greedy continuations
N_WINDOWS = 2000       # cached training windows
LR = 2e-3
WARMUP = 50
CKPT_EVERY = 50
CKPT = WORK / "drafter_ckpt.pt"
OUT = WORK / "drafter_torch"
N_GENERATED = 3072     # windows of target-generated text (see generated_windows; --generated)
GEN_PREFIX = 96        # corpus tokens before the target's greedy continuation
N_CHAT = 64            # windows of the target's greedy chat answers (greedy_windows.py)
CHAT_ROWS = 1          # of every batch, with --chat


LAYERS = 2
INTERMEDIATE = 512


def drafter_config(target_cfg, mask_token_id, layers=LAYERS, intermediate=INTERMEDIATE):
    h = target_cfg.hidden_size
    return DrafterConfig(
        hidden_size=h, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
        vocab_size=target_cfg.vocab_size, target_layer_ids=list(TARGET_LAYER_IDS),
        sliding_window=128, markov_rank=64, mask_token_id=mask_token_id)


def target_logits_from_taps(target, taps):
    """The target's logits recomputed from the last tap (the last layer's output)."""
    h = target.config.hidden_size
    assert TARGET_LAYER_IDS[-1] == len(target.model.layers) - 1
    return target.lm_head(target.model.norm_f(taps[..., -h:]))


def export_key() -> str:
    """Which exported target the cached taps belong to (a new target must not reuse them)."""
    return file_key(WORK / "target_nvfp4" / "model.safetensors")


def cached_windows(target, n_windows=N_WINDOWS):
    path = WORK / f"drafter_taps_{n_windows}_{export_key()}.pt"
    if path.exists():
        return torch.load(path)
    stream = tokens("train")
    g = np.random.default_rng(SEED)
    starts = g.integers(0, len(stream) - SEQ_LEN - 1, size=n_windows)
    ids = torch.from_numpy(np.stack([stream[s:s + SEQ_LEN] for s in starts]))
    taps = []
    t0 = time.time()
    for i in range(0, n_windows, 8):
        taps.append(target_taps(target, ids[i:i + 8])[0])
        print(f"taps {i + 8}/{n_windows} {time.time() - t0:.0f}s", flush=True)
    data = {"ids": ids, "taps": torch.cat(taps)}
    torch.save(data, path)
    return data


def generated_windows(target, n_generated):
    """Windows whose tail is the target's own greedy continuation of a corpus prefix, with taps.

    Greedy speculation drafts against exactly such text (a small model's greedy output is
    far more repetitive than the corpus), so part of every batch comes from here, the way
    DSpark/DFlash drafters train on target-regenerated data."""
    gen = WORK / f"drafter_generated_{n_generated}_{export_key()}.pt"
    if gen.exists():
        return torch.load(gen)
    stream = tokens("train")
    g = np.random.default_rng(SEED + 1)
    starts = g.integers(0, len(stream) - GEN_PREFIX, size=n_generated)
    prefixes = torch.from_numpy(np.stack([stream[s:s + GEN_PREFIX] for s in starts]))
    ids, taps = [], []
    t0 = time.time()
    for i in range(0, n_generated, 32):
        x = prefixes[i:i + 32]
        with torch.no_grad():
            out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=SEQ_LEN - GEN_PREFIX, min_new_tokens=SEQ_LEN - GEN_PREFIX,
                                  pad_token_id=0)
        ids.append(out)
        taps.append(target_taps(target, out)[0])
        print(f"generated {i + len(x)}/{n_generated} {time.time() - t0:.0f}s", flush=True)
    data = {"ids": torch.cat(ids), "taps": torch.cat(taps)}
    torch.save(data, gen)
    return data


def chat_windows(target, n):
    """The target's greedy answers to chat tasks (greedy_windows.py, made by the runtime from
    the converted target), with their taps: what the drafter drafts against in `chat`."""
    import greedy_windows

    path = WORK / f"drafter_chat_{n}_{greedy_windows.target_key()}.pt"
    if path.exists():
        return torch.load(path)
    ids = torch.from_numpy(greedy_windows.windows("chat", n))
    data = {"ids": ids, "taps": torch.cat([target_taps(target, ids[i:i + 8])[0]
                                           for i in range(0, n, 8)])}
    torch.save(data, path)
    return data


def dspark_loss(drafter, target, ids, taps, anchors, n):
    """Mean over blocks of the weighted DSpark objective; also per-position greedy agreement."""
    B, T = ids.shape
    ctx_pos = torch.arange(T)
    row_pos, mask = block_mask(ctx_pos, anchors, n, drafter.c.sliding_window)
    A, R = len(anchors), n + 1
    block_ids = torch.full((B, A, R), drafter.c.mask_token_id)
    block_ids[:, :, 0] = ids[:, anchors]
    ctx_kv = drafter.context(taps, ctx_pos)
    hid = drafter.block_hidden(block_ids.view(B, A * R), row_pos, ctx_kv, mask).view(B, A, R, -1)[:, :, 1:]
    k = torch.arange(1, n + 1)
    pos_next = anchors[:, None] + k[None, :]                # positions predicted, [A, n]
    prev = ids[:, pos_next - 1].reshape(-1)                  # Markov prev: the true token before
    # 2-D matmuls: a strided 4-D input sends F.linear down a much slower batched path.
    z = target.lm_head(hid.reshape(-1, hid.shape[-1])) + drafter.markov_head(prev)   # [B*A*n, V]
    with torch.no_grad():
        p_t = torch.softmax(target_logits_from_taps(target, taps[:, pos_next - 1].reshape(len(prev), -1)), -1)
    logp = torch.log_softmax(z.float(), -1)
    ce = F.nll_loss(logp, ids[:, pos_next].reshape(-1), reduction="none").view(B, A, n)
    tv = 0.5 * (logp.exp() - p_t).abs().sum(-1).view(B, A, n)
    w = torch.exp(-(k.float() - 1) / 4)
    loss = ((0.1 * ce + 0.9 * tv) * w).sum(-1).mean() / w.sum()
    agree = (z.argmax(-1) == p_t.argmax(-1)).float().view(B, A, n).mean((0, 1))
    return loss, agree


def lr_at(step, total, lr=LR):
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total - WARMUP))))


def make_drafter(target, tok_mask_id, layers, intermediate, init=None):
    """A fresh drafter, or (``init``: a packed drafter folder) the shipped one, dequantized,
    to fine-tune against a tuned target."""
    torch.manual_seed(SEED)
    if init is not None:
        from drafter_io import load_packed_drafter

        d = load_packed_drafter(Path(init)).train()
        d.embed_tokens.weight.requires_grad_(False)
        return d
    d = DSparkDrafter(drafter_config(target.config, tok_mask_id, layers, intermediate))
    for name, p in d.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    torch.nn.init.zeros_(d.markov_head.markov_w2.weight)  # the Markov bias starts at zero
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.model.embeddings.weight)
    d.embed_tokens.weight.requires_grad_(False)
    return d


def mask_token_id():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(WORK / "tokenizer" / "hf").convert_tokens_to_ids(MASK)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--stop-at", type=int, default=None, help="end early at this checkpointed step")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--intermediate", type=int, default=INTERMEDIATE)
    ap.add_argument("--windows", type=int, default=N_WINDOWS, help="corpus windows")
    ap.add_argument("--generated", type=int, default=N_GENERATED, help="target-generated windows")
    ap.add_argument("--chat", action="store_true",
                    help=f"--chat-rows rows of every batch from --chat-windows greedy chat-answer windows")
    ap.add_argument("--chat-windows", type=int, default=N_CHAT)
    ap.add_argument("--chat-rows", type=int, default=CHAT_ROWS, help="of every batch, with --chat")
    ap.add_argument("--init", metavar="DIR", help="fine-tune this packed drafter "
                    "(recover_target.py --drafter rebuilds the shipped one)")
    ap.add_argument("--lr", type=float, default=LR)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    target = load_dequantized()
    for p in target.parameters():
        p.requires_grad_(False)
    data = cached_windows(target, args.windows)
    gen = generated_windows(target, args.generated)
    chat = chat_windows(target, args.chat_windows) if args.chat else None
    drafter = make_drafter(target, mask_token_id(), args.layers, args.intermediate, args.init)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    step = resume(CKPT, drafter, opt)
    stop = args.stop_at or args.steps
    t0 = time.time()
    while step < stop:
        g = np.random.default_rng([SEED, step])
        # Mostly the target's own greedy continuations (what greedy speculation drafts
        # against), plus corpus text.
        rows = torch.from_numpy(g.choice(args.windows, CORPUS_ROWS, replace=False))
        n_gen = BATCH - CORPUS_ROWS - (args.chat_rows if chat else 0)
        grows = torch.from_numpy(g.choice(args.generated, n_gen, replace=False))
        parts = [(data, rows), (gen, grows)]
        if chat:
            parts.append((chat, torch.from_numpy(g.choice(args.chat_windows, args.chat_rows, replace=False))))
        ids = torch.cat([src["ids"][r] for src, r in parts])
        taps = torch.cat([src["taps"][r] for src, r in parts])
        anchors = torch.from_numpy(np.sort(g.choice(np.arange(1, SEQ_LEN - N_TRAIN), ANCHORS, replace=False)))
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args.steps, args.lr)
        loss, agree = dspark_loss(drafter, target, ids, taps, anchors, N_TRAIN)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} agree@1..3 {[round(a, 3) for a in agree[:3].tolist()]} "
                  f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
            t0 = time.time()
        if step % CKPT_EVERY == 0 or step == stop:
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT)
    OUT.mkdir(exist_ok=True)
    torch.save(drafter.state_dict(), OUT / "drafter.pt")
    (OUT / "drafter_config.json").write_text(json.dumps(asdict(drafter.c), indent=2))
    (OUT / "training_report.json").write_text(json.dumps({"steps": step, "planned_steps": args.steps}))


if __name__ == "__main__":
    main()
