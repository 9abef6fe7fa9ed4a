"""Step 8: the demo target's own MTP block (``mtp.*``), trained against the frozen shipped target.

The block is the one vLLM's ``nemotron_h_mtp`` defines and mlx_dspark/mtp.py runs, with the
pattern the demo config already names (``mtp_layers_block_type``: attention, then MoE):

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]);  x += attn(norm0 x);  x += moe(norm1 x)
    q(t_{p+2}) = softmax(lm_head(final_layernorm(x)))

``h_p`` is the target's last-layer output after ``norm_f``; the embedding and lm_head are the
target's, frozen. Features come from the MLX runtime itself (the shipped NVFP4 target in fp32,
exactly what the drafter sees at inference); the objective is the target's own next-next-token
distribution at ``p+1`` (top 16 probabilities, renormalized) on corpus windows, so that the
block predicts what the target will say, not what the corpus says. The attention layer starts
from the target's attention layer 3, the MoE from its layer 4 (both dequantized), the final
norm from ``norm_f``; ``eh_proj`` starts by passing ``hnorm(h)`` through (or everything from
an exported block, ``--init``). Drafting runs the block on its own output (vLLM's recursive
MTP), so training unrolls K steps (``--ttt``, the training-time test of EAGLE-3/SpecForge):
step k is fed step k-1's output and attends as the runtime's scratch rows do (``unroll``).
Windows: a third corpus text, a third the target's greedy continuations, a third its greedy
chat answers (greedy_windows.py).

    .venv/bin/python training/data.py && .venv/bin/python training/recover_target.py
    TRAIN_THREADS=1 .venv-train/bin/python training/train_mtp.py --ttt 3 --steps 1500
    mlx-dspark convert training/work/target_nvfp4 -o mlx_dspark/demo/target --force

It writes ``training/work/target_nvfp4/model-mtp.safetensors`` (BF16; the router F32 as in
NVIDIA's checkpoints) and sets ``num_nextn_predict_layers`` 1 in that export's config.json.
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from data import HERE, WORK

THREADS = int(os.environ.get("TRAIN_THREADS", "1"))
DEMO = HERE.parent / "mlx_dspark" / "demo" / "target"
EXPORT = WORK / "target_nvfp4"
SEQ, TOPK, SEED = 256, 16, 4321


def text_windows(n_windows: int, split: str) -> list:
    """Corpus windows of SEQ tokens at seeded character offsets."""
    from mlx_dspark.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(DEMO), None)
    text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng([SEED, n_windows, len(split)])
    starts = rng.integers(0, len(text) - 4 * SEQ * 4, size=n_windows)
    return [tok.encode(text[s:s + 16 * SEQ])[:SEQ] for s in starts]


def training_windows(n_windows: int, split: str) -> list:
    """A third corpus text, a third the target's greedy continuations of corpus prefixes, a
    third its greedy answers to chat tasks (greedy_windows.py): greedy speculation drafts
    against the target's own text, in `chat` against its answers."""
    import greedy_windows

    third = n_windows // 3
    return (text_windows(n_windows - 2 * third, split)
            + greedy_windows.windows("corpus", third, split).tolist()
            + greedy_windows.windows("chat", third, split).tolist())


def features(windows: list, taps=None):
    """Windows through the shipped target (MLX runtime, fp32): tokens [W, SEQ], hidden
    states after norm_f [W, SEQ, H] (or, with ``taps``, those layers' outputs before it,
    concatenated), the target's top-k next-token probabilities and their ids [W, SEQ, k]."""
    import mlx.core as mx

    from mlx_dspark.kernels.norm import rms_norm
    from mlx_dspark.models.nemotron_h import load_target

    target = load_target(str(DEMO), dtype=mx.float32)
    last = target.config.num_hidden_layers - 1
    ids, hid, top_p, top_i = [], [], [], []
    for t in windows:
        logits, h = target.step(mx.array([t]), target.make_cache(), tap_layers=taps or [last])
        if taps is None:
            h = rms_norm(h, target.norm_f, target.config.layer_norm_epsilon)
        p = mx.softmax(logits[0], axis=-1)
        i = mx.argsort(-p, axis=-1)[:, :TOPK]
        ids.append(t)
        hid.append(np.array(h))
        top_i.append(np.array(i))
        top_p.append(np.array(mx.take_along_axis(p, i, axis=-1)))
    return (torch.tensor(np.array(ids)), torch.tensor(np.array(hid)),
            torch.tensor(np.array(top_p)), torch.tensor(np.array(top_i).astype(np.int64)), target)


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MTP(torch.nn.Module):
    def __init__(self, t):
        """``t``: the MLX target, whose layers 3 (attention) and 4 (MoE) seed the block."""
        super().__init__()
        import mlx.core as mx
        c = t.config
        h = c.hidden_size

        def arr(x):
            return torch.tensor(np.array(x.astype(mx.float32)))

        def dense(lin):
            return arr(lin.dequantized() if hasattr(lin, "dequantized") else lin.weight * getattr(
                lin, "scale", 1.0))

        def experts(e):
            w = mx.dequantize(e.weight, e.scales, group_size=16, bits=4, mode="nvfp4",
                              dtype=mx.float32)
            return arr(w * e.weight_scale_2[:, None, None])

        P = torch.nn.Parameter
        attn, moe = t.layers[3].mixer, t.layers[4].mixer
        self.heads, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.topk, self.scaling = c.num_experts_per_tok, c.routed_scaling_factor
        self.enorm, self.hnorm = P(torch.ones(h)), P(torch.ones(h))
        eh = torch.zeros(h, 2 * h)
        eh[:, h:] = torch.eye(h)
        eh[:, :h] = torch.randn(h, h, generator=torch.Generator().manual_seed(SEED)) * 0.02
        self.eh_proj = P(eh)
        self.norm0, self.norm1 = P(arr(t.layers[3].norm_weight)), P(arr(t.layers[4].norm_weight))
        self.q, self.k, self.v, self.o = (P(dense(getattr(attn, n))) for n in
                                          ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.gate, self.bias = P(arr(moe.gate.weight)), P(arr(moe.gate.e_score_correction_bias))
        self.up, self.down = P(experts(moe.experts.up_proj)), P(experts(moe.experts.down_proj))
        self.sup = P(dense(moe.shared_experts.up_proj))
        self.sdown = P(dense(moe.shared_experts.down_proj))
        self.final = P(arr(t.norm_f))
        self.embed = arr(t.embeddings)                  # frozen, the target's
        self.lm_head = dense(t.head)

    def first(self, hidden):
        """Step 1's input state: the target's hidden state itself."""
        return hidden

    def qkv(self, next_ids, hidden, pos0):
        """The fused rows and their attention's q, k, v ([B, heads, n, hd], K/V repeated
        over the query heads). Nemotron-H attention has no positional encoding: ``pos0``
        is unused."""
        b, n, h = hidden.shape
        x = torch.cat([rms(self.embed[next_ids], self.enorm), rms(hidden, self.hnorm)], -1)
        x = x @ self.eh_proj.T
        a = rms(x, self.norm0)
        q = (a @ self.q.T).view(b, n, self.heads, self.hd).transpose(1, 2)
        k = (a @ self.k.T).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = (a @ self.v.T).view(b, n, self.kv, self.hd).transpose(1, 2)
        rep = self.heads // self.kv
        return x, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, x, o):
        """After the attention: the MoE layer and the final norm -> (the next step's hidden
        state, the logits)."""
        b, n, _ = x.shape
        x = x + o.transpose(1, 2).reshape(b, n, -1) @ self.o.T
        m = rms(x, self.norm1)
        scores = torch.sigmoid(m @ self.gate.T)
        idx = torch.topk(scores + self.bias.detach(), self.topk, -1).indices
        w = torch.gather(scores, -1, idx)
        w = w / w.sum(-1, keepdim=True) * self.scaling
        y = torch.zeros_like(m)
        for e in range(self.up.shape[0]):
            sel = (idx == e)
            if sel.any():
                gate_e = (w * sel).sum(-1, keepdim=True)
                y = y + gate_e * (F.relu(m @ self.up[e].T).pow(2) @ self.down[e].T)
        x = x + y + F.relu(m @ self.sup.T).pow(2) @ self.sdown.T
        out = rms(x, self.final)
        return out, out @ self.lm_head.T

    def named(self) -> dict:
        """The block's tensors by their export names (views of the parameters)."""
        out = {"mtp.layers.0.enorm.weight": self.enorm, "mtp.layers.0.hnorm.weight": self.hnorm,
               "mtp.layers.0.eh_proj.weight": self.eh_proj, "mtp.layers.0.norm.weight": self.norm0,
               "mtp.layers.1.norm.weight": self.norm1,
               "mtp.layers.1.final_layernorm.weight": self.final,
               "mtp.layers.1.mixer.shared_experts.up_proj.weight": self.sup,
               "mtp.layers.1.mixer.shared_experts.down_proj.weight": self.sdown,
               "mtp.layers.1.mixer.gate.weight": self.gate,
               "mtp.layers.1.mixer.gate.e_score_correction_bias": self.bias}
        for n in ("q", "k", "v", "o"):
            out[f"mtp.layers.0.mixer.{n}_proj.weight"] = getattr(self, n)
        for e in range(self.up.shape[0]):
            out[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] = self.up[e]
            out[f"mtp.layers.1.mixer.experts.{e}.down_proj.weight"] = self.down[e]
        return out

    def tensors(self) -> dict:
        """BF16, the router F32 as in NVIDIA's checkpoints."""
        return {k: v.detach().to(torch.float32 if ".gate." in k else torch.bfloat16).contiguous()
                for k, v in self.named().items()}


def start_from(model, path):
    """Seed a head from an exported one (the shipped head: a fine-tune, not a retrain)."""
    saved = load_file(path)
    with torch.no_grad():
        for name, live in model.named().items():
            live.copy_(saved[name].float())
    print(f"started from {path}", flush=True)


def chain_attention(q, k1, v1, chain_k, chain_v):
    """Attention of one drafting step's rows (row p: ``q [B, H, n, d]``) over the context rows
    0..p (step 1's keys and values ``k1``, ``v1``) and over their own chain's rows of steps
    2..k (lists of ``[B, H, n, d]``, the step's own row last), as the runtime's draft attends
    to its cache and its scratch rows. Step 1 (empty chain) is plain causal attention."""
    n, d = q.shape[2], q.shape[-1]
    scores = (q @ k1.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    diag = [(q * kc).sum(-1, keepdim=True) * d ** -0.5 for kc in chain_k]
    w = torch.softmax(torch.cat([scores] + diag, -1), -1)
    out = w[..., :n] @ v1
    for i, vc in enumerate(chain_v):
        out = out + w[..., n + i:n + i + 1] * vc
    return out


def unroll(model, ids, feats, steps):
    """Training-time test (EAGLE-3's and SpecForge's TTT; the MTP block run on its own output
    as vLLM drafts with it): the logits of drafting steps 1..steps for all rows p = 0..T-2 at
    once. Step 1's row p is fed the token ids[p+1] with the target's features of p, causally:
    the context rows the runtime keeps. Step k's row p is fed ids[p+k] (the target's token:
    only a chain whose drafts were accepted matters) with step k-1's output of row p, at
    position p+k-1, and attends to the context rows 0..p and its own chain's later rows.
    Row p of step k predicts token p+k+1; rows past the window's end are padding."""
    n = ids.shape[1] - 1
    g = model.first(feats[:, :n])
    logits, chain_k, chain_v = [], [], []
    for k in range(1, steps + 1):
        tok = F.pad(ids[:, k:k + n], (0, k - 1))
        state, q, kk, v = model.qkv(tok, g, k - 1)
        if k == 1:
            k1, v1 = kk, v
        else:
            chain_k.append(kk)
            chain_v.append(v)
        g, z = model.finish(state, chain_attention(q, k1, v1, chain_k, chain_v))
        logits.append(z)
    return logits


def distill_loss(model, ids, inputs, top_p, top_i, steps):
    """Over steps k (weight 0.8^(k-1), SpecForge's) and their valid rows p: cross-entropy
    against the target's distribution of token p+k+1 (its top k, renormalized), i.e. KL up to a
    constant."""
    total, weights = 0.0, 0.0
    for k, z in enumerate(unroll(model, ids, inputs, steps), 1):
        rows = ids.shape[1] - k
        logq = F.log_softmax(z[:, :rows], -1)
        p = top_p[:, k:] / top_p[:, k:].sum(-1, keepdim=True)
        total = total - 0.8 ** (k - 1) * (p * torch.gather(logq, -1, top_i[:, k:])).sum(-1).mean()
        weights += 0.8 ** (k - 1)
    return total / weights


def agreement(model, ids, inputs, top_i, steps) -> list:
    """Per step, the share of valid rows whose argmax is the target's greedy token (step k:
    greedy acceptance at draft position k, given the earlier drafts were accepted)."""
    with torch.no_grad():
        return [round((z[:, :ids.shape[1] - k].argmax(-1) == top_i[:, k:, 0]).float().mean().item(), 3)
                for k, z in enumerate(unroll(model, ids, inputs, steps), 1)]


def arguments(doc: str, steps=700, windows=192, batch=8, lr=1e-3, **more: int):
    """The training scripts' command line (``more``: further integer options and their
    defaults); one thread, the seed set."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--windows", type=int, default=windows)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=lr)
    for name, default in more.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--ttt", type=int, default=3, metavar="K",
                    help="drafting steps unrolled in training (training-time test; 1: one step)")
    ap.add_argument("--init", metavar="SAFETENSORS", help="start from this exported head")
    ap.add_argument("--crop", type=int, default=SEQ, help="train on this many tokens of each window")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    return args


def fit(model, params, args, data, held, t0, save):
    """AdamW, cosine to 10% of ``lr``; the loss every 10 steps, ``save()`` every 50 and at the
    end (a run cut short still leaves its latest head), per-step held-out agreement at both
    ends."""
    ids, inputs, top_p, top_i = data
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = np.random.default_rng(SEED)
    for name, h in held.items():
        print(f"step 0: held-out {name} agreement by step {agreement(model, *h, args.ttt)}", flush=True)
    for step in range(1, args.steps + 1):
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        b = torch.tensor(g.integers(0, len(ids), args.batch))
        c = slice(s := int(g.integers(0, ids.shape[1] - args.crop + 1)), s + args.crop)
        loss = distill_loss(model, ids[b, c], inputs[b, c], top_p[b, c], top_i[b, c], args.ttt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
        if step % 50 == 0 or step == args.steps:
            save()
    for name, h in held.items():
        print(f"step {step}: held-out {name} agreement by step {agreement(model, *h, args.ttt)}",
              flush=True)


def held_out(taps=None, n=8) -> dict:
    """(ids, features, top ids) of n held-out corpus windows and n greedy chat windows on
    held-out tasks."""
    import greedy_windows

    out = {}
    for name, windows in (("corpus", text_windows(32, "heldout")[:n]),
                          ("chat", greedy_windows.windows("chat", 16, "heldout").tolist()[:n])):
        i, f, _, top, _ = features(windows, taps)
        out[name] = (i, f, top)
    return out


def main():
    args = arguments(__doc__)
    t0 = time.time()
    ids, hid, top_p, top_i, target = features(training_windows(args.windows, "train"))
    held = held_out()
    print(f"features: {args.windows} + 16 held-out windows in {time.time() - t0:.0f} s", flush=True)
    model = MTP(target)
    del target
    if args.init:
        start_from(model, args.init)
    fit(model, [p for n, p in model.named_parameters() if n != "bias"], args,
        (ids, hid, top_p, top_i), held, t0, lambda: save(model))


def save(model):
    save_file(model.tensors(), EXPORT / "model-mtp.safetensors", metadata={"format": "pt"})
    cfg = json.loads((EXPORT / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (EXPORT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {EXPORT / 'model-mtp.safetensors'}", flush=True)


if __name__ == "__main__":
    main()
