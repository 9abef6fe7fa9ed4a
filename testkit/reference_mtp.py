"""Float64 NumPy reference of Nemotron-H's native MTP block, for tests only.

Written from vLLM's ``nemotron_h_mtp`` definition (NemotronHMultiTokenPredictor: the first
layer of the pattern fuses ``cat(enorm(embedding), hnorm(hidden))`` through ``eh_proj``, every
layer is Nemotron-H's pre-norm residual block, the last ends in ``final_layernorm``; the
target's hidden state is its model output, after ``norm_f``; multi-token drafting feeds each
step's output back as the next hidden state), not from mlx_dspark/mtp.py. Stateless: every
step recomputes the whole causal sequence of (hidden, next token) rows.
"""

from __future__ import annotations

import numpy as np


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def attention(x, w, p, heads, kv_heads):
    t, d = x.shape[0], w[f"{p}.q_proj.weight"].shape[0] // heads
    q = (x @ w[f"{p}.q_proj.weight"].T).reshape(t, heads, d)
    k = (x @ w[f"{p}.k_proj.weight"].T).reshape(t, kv_heads, d)
    v = (x @ w[f"{p}.v_proj.weight"].T).reshape(t, kv_heads, d)
    out = np.zeros((t, heads, d))
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i in range(t):
            s = k[:i + 1, g] @ q[i, h] / np.sqrt(d)
            a = np.exp(s - s.max())
            out[i, h] = (a / a.sum()) @ v[:i + 1, g]
    return out.reshape(t, -1) @ w[f"{p}.o_proj.weight"].T


def moe(x, w, p, top_k, scaling):
    scores = 1 / (1 + np.exp(-(x @ w[f"{p}.gate.weight"].T)))
    choice = scores + w[f"{p}.gate.e_score_correction_bias"]
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        idx = np.argsort(-choice[i], kind="stable")[:top_k]
        wts = scores[i, idx] / scores[i, idx].sum() * scaling
        for e, a in zip(idx, wts):
            up = np.maximum(w[f"{p}.experts.up_proj.weight"][e] @ x[i], 0) ** 2
            out[i] += a * (w[f"{p}.experts.down_proj.weight"][e] @ up)
    shared = np.maximum(x @ w[f"{p}.shared_experts.up_proj.weight"].T, 0) ** 2
    return out + shared @ w[f"{p}.shared_experts.down_proj.weight"].T


def block(rows_hidden, rows_tokens, w, t, pattern):
    """The block over the rows (hidden [T, H], next token ids [T]) -> outputs [T, H]."""
    eps = t["eps"]
    e = t["embed"][rows_tokens]
    x = np.concatenate([rms(e, w["mtp.layers.0.enorm.weight"], eps),
                        rms(rows_hidden, w["mtp.layers.0.hnorm.weight"], eps)], -1)
    x = x @ w["mtp.layers.0.eh_proj.weight"].T
    for i, kind in enumerate(pattern):
        p = f"mtp.layers.{i}"
        h = rms(x, w[f"{p}.norm.weight"], eps)
        x = x + (attention(h, w, f"{p}.mixer", t["heads"], t["kv_heads"]) if kind == "*"
                 else moe(h, w, f"{p}.mixer", t["top_k"], t["scaling"]))
    return rms(x, w[f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight"], eps)


def propose(taps_last, tokens, bonus, n, w, t, pattern):
    """Greedy drafts and their logits after ``tokens`` (their last-layer pre-norm taps
    ``taps_last [P, H]``) and the bonus."""
    hidden = list(rms(taps_last, t["norm_f"], t["eps"]))
    nxt = list(tokens[1:]) + [bonus]
    drafts, logits = [], []
    for _ in range(n):
        out = block(np.array(hidden), np.array(nxt), w, t, pattern)[-1]
        z = t["lm_head"] @ out
        d = int(np.argmax(z))
        drafts.append(d)
        logits.append(z)
        hidden.append(out)
        nxt.append(d)
    return drafts, np.array(logits)
