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
norm from ``norm_f``; ``eh_proj`` starts by passing ``hnorm(h)`` through.

    .venv/bin/python training/data.py && .venv/bin/python training/recover_target.py
    TRAIN_THREADS=1 .venv/bin/python training/train_mtp.py --steps 1500
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
from safetensors.torch import save_file

from data import HERE, WORK

THREADS = int(os.environ.get("TRAIN_THREADS", "1"))
DEMO = HERE.parent / "mlx_dspark" / "demo" / "target"
EXPORT = WORK / "target_nvfp4"
SEQ, TOPK, SEED = 256, 16, 4321


def features(n_windows: int, split: str, taps=None):
    """Corpus windows through the shipped target (MLX runtime, fp32): tokens [W, SEQ], hidden
    states after norm_f [W, SEQ, H] (or, with ``taps``, those layers' outputs before it,
    concatenated), the target's top-k next-token probabilities and their ids [W, SEQ, k]."""
    import mlx.core as mx

    from mlx_dspark.kernels.norm import rms_norm
    from mlx_dspark.models.nemotron_h import load_target
    from mlx_dspark.text.tokenizer import load_tokenizer

    target = load_target(str(DEMO), dtype=mx.float32)
    tok = load_tokenizer(str(DEMO), target.config.vocab_size)
    text = (WORK / f"{split}.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng([SEED, n_windows, len(split)])
    starts = rng.integers(0, len(text) - 4 * SEQ * 4, size=n_windows)
    last = target.config.num_hidden_layers - 1
    ids, hid, top_p, top_i = [], [], [], []
    for s in starts:
        t = tok.encode(text[s:s + 16 * SEQ])[:SEQ]
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

    def forward(self, next_ids, hidden):
        b, n, h = hidden.shape
        x = torch.cat([rms(self.embed[next_ids], self.enorm), rms(hidden, self.hnorm)], -1)
        x = x @ self.eh_proj.T
        a = rms(x, self.norm0)
        q = (a @ self.q.T).view(b, n, self.heads, self.hd).transpose(1, 2)
        k = (a @ self.k.T).view(b, n, self.kv, self.hd).transpose(1, 2)
        v = (a @ self.v.T).view(b, n, self.kv, self.hd).transpose(1, 2)
        rep = self.heads // self.kv
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
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
        return rms(x, self.final) @ self.lm_head.T

    def tensors(self) -> dict:
        bf = torch.bfloat16
        out = {"mtp.layers.0.enorm.weight": self.enorm, "mtp.layers.0.hnorm.weight": self.hnorm,
               "mtp.layers.0.eh_proj.weight": self.eh_proj, "mtp.layers.0.norm.weight": self.norm0,
               "mtp.layers.1.norm.weight": self.norm1,
               "mtp.layers.1.final_layernorm.weight": self.final,
               "mtp.layers.1.mixer.shared_experts.up_proj.weight": self.sup,
               "mtp.layers.1.mixer.shared_experts.down_proj.weight": self.sdown}
        for n in ("q", "k", "v", "o"):
            out[f"mtp.layers.0.mixer.{n}_proj.weight"] = getattr(self, n)
        for e in range(self.up.shape[0]):
            out[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] = self.up[e]
            out[f"mtp.layers.1.mixer.experts.{e}.down_proj.weight"] = self.down[e]
        out = {k: v.detach().to(bf).contiguous() for k, v in out.items()}
        out["mtp.layers.1.mixer.gate.weight"] = self.gate.detach().float().contiguous()
        out["mtp.layers.1.mixer.gate.e_score_correction_bias"] = self.bias.detach().float()
        return out


def distill_loss(model, ids, inputs, top_p, top_i):
    """Rows p = 0..SEQ-2 (the features of p, the token p+1) against the target's distribution
    at p+1 (its top k, renormalized): cross-entropy, i.e. KL up to a constant."""
    logq = F.log_softmax(model(ids[:, 1:], inputs[:, :-1]), -1)
    p = top_p[:, 1:] / top_p[:, 1:].sum(-1, keepdim=True)
    return -(p * torch.gather(logq, -1, top_i[:, 1:])).sum(-1).mean()


def agreement(model, ids, inputs, top_i) -> float:
    """Share of rows whose argmax is the target's (greedy acceptance at position 1)."""
    with torch.no_grad():
        return (model(ids[:, 1:], inputs[:, :-1]).argmax(-1) == top_i[:, 1:, 0]).float().mean()


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
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    return args


def fit(model, params, args, data, held, t0):
    """AdamW, cosine to 10% of ``lr``; held-out agreement every 100 steps."""
    ids, inputs, top_p, top_i = data
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = np.random.default_rng(SEED)
    print(f"step 0: held-out agreement {agreement(model, *held):.3f}", flush=True)
    for step in range(1, args.steps + 1):
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        b = torch.tensor(g.integers(0, len(ids), args.batch))
        loss = distill_loss(model, ids[b], inputs[b], top_p[b], top_i[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step}: loss {loss.item():.3f}, held-out agreement "
                  f"{agreement(model, *held):.3f} ({time.time() - t0:.0f} s)", flush=True)


def main():
    args = arguments(__doc__)
    t0 = time.time()
    ids, hid, top_p, top_i, target = features(args.windows, "train")
    hids, hhid, _, hi, _ = features(32, "heldout")
    print(f"features: {args.windows} + 32 held-out windows in {time.time() - t0:.0f} s", flush=True)
    model = MTP(target)
    del target
    fit(model, [p for n, p in model.named_parameters() if n != "bias"], args,
        (ids, hid, top_p, top_i), (hids, hhid, hi), t0)
    save_file(model.tensors(), EXPORT / "model-mtp.safetensors", metadata={"format": "pt"})
    cfg = json.loads((EXPORT / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (EXPORT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {EXPORT / 'model-mtp.safetensors'}")


if __name__ == "__main__":
    main()
