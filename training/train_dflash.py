"""Step 10: a DFlash head for the demo target, in z-lab's layout (``DFlashDraftModel``).

The drafter mlx_dspark/drafters/dflash.py runs: ``fc`` over the taps of target layers 1, 3, 5
(their outputs before ``norm_f``, concatenated) then ``hidden_norm``, injected as context K/V into
both layers; the block ``[bonus, mask x 7]`` embedded with the target's frozen embedding; two
Qwen3 layers (4 heads / 2 KV heads x 48, q/k RMSNorm before rotate-half RoPE 1e4, sliding window
128, **non-causal within the block**, no sinks), SwiGLU 512, final norm (from ``norm_f``), the
target's frozen lm_head. Block size 8 as in z-lab's and NVIDIA's checkpoints.

Data, from the MLX runtime itself (the shipped NVFP4 target in fp32, what the drafter sees at
inference): windows of 256 tokens whose last 160 are the target's own greedy continuation of a
96-token corpus prefix (greedy speculation drafts against exactly such text), plus plain corpus
windows (one target forward each, where a generated one costs a generation); per window the taps
and the target's top-16 next-token probabilities; ``--short`` adds generated windows from an
8-token prefix, as a prompt is. Each batch is half generated, half corpus.
``--init`` starts from an earlier export: the demo head continues the head trained against the
target the chat-tuned one was tuned from (that run's ``dflash_export`` kept as ``dflash_prev``).

Objective: for each anchor ``P`` (bonus = the token at P, context = taps of positions < P) and
block row k = 1..4 (rows 5..7 run, and are seen by the others, but carry no loss), cross-entropy of the drafter's row against the target's distribution for
position P+k (its top 16, renormalized), weighted exp(-(k-1)/2) (N = 3 is the use this pair is
built for); 48 anchors per window, all blocks of a window in one attention call.

    .venv/bin/python training/data.py
    TRAIN_THREADS=1 $FX training/train_dflash.py --steps 1200 --windows 64 --corpus 96  # old target
    mv training/work/dflash_export training/work/dflash_prev     # then, the chat-tuned target:
    TRAIN_THREADS=1 $FX training/train_dflash.py --steps STEPS --windows 96 --corpus 256 \
        --lr LR --init training/work/dflash_prev/model.safetensors
    PYTHONPATH=training $FX training/pack_dflash.py
    mlx-dspark convert training/work/dflash_nvfp4 -o mlx_dspark/demo/dflash

``$FX``: a Python with torch 2.13 and the runtime (this repo's .venv with torch installed, or a
torch venv that adds .venv's site-packages).
"""
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from data import HERE, WORK
from greedy_windows import target_key
from train_mtp import SEED, arguments

DEMO = HERE.parent / "mlx_dspark" / "demo" / "target"
OUT = WORK / "dflash_export"
CACHE = "dflash_{}.npz"               # keyed by the target's weights: a new target, new data
SEQ, PREFIX, TOPK = 256, 96, 16
SHORT = 8                # --short windows: a prompt-sized prefix, then 248 generated tokens
TAPS, BLOCK, WINDOW = [1, 3, 5], 8, 128
LAYERS, HEADS, KV, HD, INTER = 2, 4, 2, 48, 512
ANCHORS, MASK_ID = 48, 6
TRAIN_ROWS = 4           # rows 1..4 carry the loss (N = 3 is the use); 5..7 only attend


def windows(n: int, split: str, prefix: int):
    """``n`` windows through the shipped target (MLX, fp32): tokens [n, SEQ], taps [n, SEQ,
    3*hidden] (float16), the target's top-k next-token probabilities and ids [n, SEQ, k].
    ``prefix``: that many corpus tokens, then the target's greedy continuation; 0: corpus."""
    path = WORK / CACHE.format(f"{split}_{n}_{prefix}_{target_key()}")
    if path.exists():
        d = np.load(path)
        return d["ids"], d["taps"], d["top_p"], d["top_i"]
    import mlx.core as mx

    from mlx_dspark.models.nemotron_h import load_target
    from mlx_dspark.text.tokenizer import load_tokenizer

    target = load_target(str(DEMO), dtype=mx.float32)
    tok = load_tokenizer(str(DEMO), target.config.vocab_size)
    text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng([SEED, n, len(split), int(prefix > 0)])
    starts = rng.integers(0, len(text) - 64 * SEQ, size=n)
    ids, taps, top_p, top_i = [], [], [], []
    t0 = time.time()
    for w, s in enumerate(starts):
        t = tok.encode(text[s:s + 16 * SEQ])[:prefix or SEQ]
        if prefix:                      # the target's own greedy continuation
            cache = target.make_cache()
            logits, _ = target.step(mx.array([t]), cache, last_only=True)
            while len(t) < SEQ:
                nxt = int(mx.argmax(logits[0, -1]))
                t.append(nxt)
                logits, _ = target.step(mx.array([[nxt]]), cache)
        logits, h = target.step(mx.array([t]), target.make_cache(), tap_layers=TAPS)
        p = mx.softmax(logits[0], axis=-1)
        i = mx.argsort(-p, axis=-1)[:, :TOPK]
        ids.append(t)
        taps.append(np.array(h.astype(mx.float16)))
        top_i.append(np.array(i).astype(np.int16))
        top_p.append(np.array(mx.take_along_axis(p, i, axis=-1)).astype(np.float16))
        if w % 64 == 63:
            print(f"{split} windows ({f'prefix {prefix}' if prefix else 'corpus'}) {w + 1}/{n} "
                  f"{time.time() - t0:.0f} s", flush=True)
    out = dict(ids=np.array(ids), taps=np.array(taps), top_p=np.array(top_p),
               top_i=np.array(top_i))
    np.savez(path, **out)
    return out["ids"], out["taps"], out["top_p"], out["top_i"]


def target_tensors():
    """The target's embedding, lm_head (dequantized) and norm_f, as float32 torch tensors."""
    import mlx.core as mx

    from mlx_dspark.models.nemotron_h import load_target

    t = load_target(str(DEMO), dtype=mx.float32)

    def arr(x):
        return torch.tensor(np.array(x.astype(mx.float32)))

    head = t.head
    w = head.dequantized() if hasattr(head, "dequantized") else head.weight
    return arr(t.embeddings), arr(w), arr(t.norm_f), t.config


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta=10000.0):
    """Rotate-half RoPE over the full head dim: x [..., T, d] at positions pos [T]."""
    d = x.shape[-1]
    ang = pos.float()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


class DFlash(torch.nn.Module):
    def __init__(self, embed, lm_head, norm_f):
        super().__init__()
        h = embed.shape[1]
        g = torch.Generator().manual_seed(SEED)
        P = torch.nn.Parameter

        def lin(out, inp, zero=False):
            return P(torch.zeros(out, inp) if zero else torch.randn(out, inp, generator=g) * inp ** -0.5)

        self.fc, self.hidden_norm = lin(h, len(TAPS) * h), P(torch.ones(h))
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            m = torch.nn.Module()
            m.q, m.k, m.v = lin(HEADS * HD, h), lin(KV * HD, h), lin(KV * HD, h)
            m.o = lin(h, HEADS * HD, zero=True)
            m.q_norm, m.k_norm = P(torch.ones(HD)), P(torch.ones(HD))
            m.ln1, m.ln2 = P(torch.ones(h)), P(torch.ones(h))
            m.gate, m.up, m.down = lin(INTER, h), lin(INTER, h), lin(h, INTER, zero=True)
            self.layers.append(m)
        self.norm = P(norm_f.clone())
        self.embed, self.lm_head = embed, lm_head            # the target's, frozen

    @staticmethod
    def heads(m, x, proj, norm, n, pos):
        b, t, _ = x.shape
        return rope(rms((x @ proj.T).view(b, t, n, HD), norm).transpose(1, 2), pos)

    def forward(self, taps, block_ids, ctx_pos, row_pos, mask):
        """taps [b, C, 3h] at ctx_pos [C]; block rows block_ids [b, R] at row_pos [R];
        mask [R, C+R] (True: attend). Returns the rows' final-normed hidden states."""
        b = taps.shape[0]
        c = rms(taps @ self.fc.T, self.hidden_norm)
        x = self.embed[block_ids]
        for m in self.layers:
            a = rms(x, m.ln1)
            q = self.heads(m, a, m.q, m.q_norm, HEADS, row_pos)
            k = torch.cat([self.heads(m, c, m.k, m.k_norm, KV, ctx_pos),
                           self.heads(m, a, m.k, m.k_norm, KV, row_pos)], 2)
            v = torch.cat([(c @ m.v.T).view(b, -1, KV, HD), (a @ m.v.T).view(b, -1, KV, HD)],
                          1).transpose(1, 2)
            rep = HEADS // KV
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(b, x.shape[1], -1) @ m.o.T
            f = rms(x, m.ln2)
            x = x + (F.silu(f @ m.gate.T) * (f @ m.up.T)) @ m.down.T
        return rms(x, self.norm)

    def load(self, path):
        """Start from an earlier export (``tensors``' names): a head trained against the target
        this one was tuned from already knows most of the task."""
        src = load_file(path)
        for name, p in self.named_tensors().items():
            p.data.copy_(src[name].float())

    def tensors(self) -> dict:
        return {k: v.detach().to(torch.bfloat16).contiguous()
                for k, v in self.named_tensors().items()}

    def named_tensors(self) -> dict:
        """z-lab's tensor names (the runtime borrows the target's embedding and lm_head)."""
        out = {"fc.weight": self.fc, "hidden_norm.weight": self.hidden_norm,
               "norm.weight": self.norm}
        names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                 "ln1": "input_layernorm", "ln2": "post_attention_layernorm",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
        for i, m in enumerate(self.layers):
            for short, long in names.items():
                out[f"layers.{i}.{long}.weight"] = getattr(m, short)
        return out


def block_mask(anchors, seq):
    """Every anchor's block in one call. Rows: for anchor P, [bonus, mask x 7] at P..P+7.
    Keys: the context positions 0..seq-1, then every row. A row sees context positions < P
    within the window, and every row of its own block (non-causal)."""
    r = torch.arange(BLOCK)
    row_anchor = anchors.repeat_interleave(BLOCK)
    row_pos = row_anchor + r.repeat(len(anchors))
    ctx = torch.arange(seq)
    see_ctx = (ctx[None] < row_anchor[:, None]) & (row_pos[:, None] - ctx[None] < WINDOW)
    see_rows = row_anchor[:, None] == row_anchor[None, :]
    return ctx, row_pos, torch.cat([see_ctx, see_rows], 1)


def loss_and_agreement(model, ids, taps, top_p, top_i, anchors):
    b = ids.shape[0]
    ctx_pos, row_pos, mask = block_mask(anchors, ids.shape[1])
    block = torch.full((b, len(anchors), BLOCK), MASK_ID)
    block[:, :, 0] = ids[:, anchors]
    h = model(taps, block.view(b, -1), ctx_pos, row_pos, mask).view(b, len(anchors), BLOCK, -1)
    logq = F.log_softmax(h[:, :, 1:TRAIN_ROWS + 1] @ model.lm_head.T, -1)   # [b, A, rows, V]
    at = anchors[:, None] + torch.arange(TRAIN_ROWS)[None]           # the position each row's
    p, i = top_p[:, at], top_i[:, at]                                # token follows: P+k-1
    p = p / p.sum(-1, keepdim=True)
    ce = -(p * torch.gather(logq, -1, i)).sum(-1)                    # [b, A, rows]
    w = torch.exp(-torch.arange(TRAIN_ROWS).float() / 2)
    agree = (logq.argmax(-1) == i[..., 0]).float().mean((0, 1))
    return (ce * w).sum(-1).mean() / w.sum(), agree


def tokens_per_round(model, data, n=3, rounds_per_window=24):
    """Greedy tokens per round at N = n replayed on held-out generated windows: the target's
    greedy text is known, so the drafter's block at P is compared with it (a + 1 per round)."""
    ids, taps, _, top_i = data
    total = count = 0
    with torch.no_grad():
        for w in range(len(ids)):
            pos = PREFIX
            for _ in range(rounds_per_window):
                if pos + n + 1 > ids.shape[1]:
                    break
                a = torch.tensor([pos])
                ctx_pos, row_pos, mask = block_mask(a, pos)
                blk = torch.full((1, BLOCK), MASK_ID)
                blk[0, 0] = ids[w, pos]
                h = model(taps[w:w + 1, :pos], blk, ctx_pos, row_pos, mask)
                drafts = (h[0, 1:n + 1] @ model.lm_head.T).argmax(-1)
                want = top_i[w, pos:pos + n, 0]
                acc = int((drafts == want).long().cumprod(0).sum())
                total, count = total + acc + 1, count + 1
                pos += acc + 1
    return total / count


def main():
    args = arguments(__doc__, steps=1200, windows=64, batch=4, lr=2e-3, corpus=96, short=0)
    t0 = time.time()
    types = [np.int64, np.float32, np.float32, np.int64]
    generated, corpus, held = (
        [torch.tensor(np.concatenate(x).astype(t)) for x, t in zip(zip(*parts), types)]
        for parts in ([windows(args.windows, "train", PREFIX)]
                      + ([windows(args.short, "train", SHORT)] if args.short else []),
                      [windows(args.corpus, "train", 0)], [windows(16, "heldout", PREFIX)]))
    print(f"data: {len(generated[0])} generated + {len(corpus[0])} corpus windows, "
          f"{time.time() - t0:.0f} s", flush=True)
    embed, lm_head, norm_f, tcfg = target_tensors()
    model = DFlash(embed, lm_head, norm_f)
    if args.init:
        model.load(args.init)
        print(f"step 0: held-out greedy tokens/round at N=3 (replayed) "
              f"{tokens_per_round(model, held):.3f}", flush=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = np.random.default_rng(SEED)
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        # Half of each batch generated, half corpus, however many of each there are: the
        # generated windows are the text greedy speculation drafts against, the corpus ones
        # (one forward each, not a generation) add variety.
        half = args.batch // 2
        rows = [torch.tensor(g.integers(0, len(part[0]), n))
                for part, n in ((generated, args.batch - half), (corpus, half))]
        batch = [torch.cat([generated[j][rows[0]], corpus[j][rows[1]]]) for j in range(4)]
        anchors = torch.tensor(np.sort(g.choice(np.arange(1, SEQ - BLOCK), ANCHORS, replace=False)))
        loss, agree = loss_and_agreement(model, *batch, anchors)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f} agree {[round(a, 2) for a in agree[:4].tolist()]} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        if step % 500 == 0 or step == args.steps:
            print(f"step {step}: held-out greedy tokens/round at N=3 (replayed) "
                  f"{tokens_per_round(model, held):.3f}", flush=True)
    export(model, tcfg)


def export(model, tcfg):
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(model.tensors(), OUT / "model.safetensors", metadata={"format": "pt"})
    h = tcfg.hidden_size
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "mlx_dspark_demo": "mlx-dspark demonstration DFlash drafter for the demonstration "
                           "target; a demonstration model, not Nemotron and not NVIDIA's release",
        "hidden_size": h, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "vocab_size": tcfg.vocab_size,
        "max_position_embeddings": 65536, "layer_types": ["sliding_attention"] * LAYERS,
        "sliding_window": WINDOW, "is_causal": False, "block_size": BLOCK,
        "num_target_layers": tcfg.num_hidden_layers, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
        "torch_dtype": "bfloat16",
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
