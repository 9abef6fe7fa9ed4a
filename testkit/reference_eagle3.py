"""Float64 NumPy reference of an EAGLE-3 head (``LlamaForCausalLMEagle3``), for tests only.

Written from vLLM's ``llama_eagle3`` definition (first decoder layer over
``cat(input_layernorm(embeds), hidden_norm(hidden))``, residual = the un-normed hidden, Llama
attention with rotate-half RoPE at the target positions, SwiGLU MLP; ``norm`` then the
draft-vocabulary ``lm_head``, scattered to target ids by ``id + d2t[id]`` with -inf elsewhere;
``fc`` over the auxiliary hidden states; later steps feed the pre-norm output back one position
on), not from mlx_dspark/eagle3.py. Stateless: every step recomputes all rows.
"""

from __future__ import annotations

import numpy as np

from testkit.reference_mtp import rms


def rope(x, pos, theta):
    """x [T, heads, d] at positions pos [T], rotate-half convention."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * freq[None]                       # [T, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def layer(g, ids, pos, w, t):
    eps, heads, kv, d = t["eps"], t["heads"], t["kv_heads"], t["head_dim"]
    m = "midlayer"
    x = np.concatenate([rms(t["embed"][ids], w[f"{m}.input_layernorm.weight"], eps),
                        rms(g, w[f"{m}.hidden_norm.weight"], eps)], -1)
    n = x.shape[0]
    q = rope((x @ w[f"{m}.self_attn.q_proj.weight"].T).reshape(n, heads, d), pos, t["theta"])
    k = rope((x @ w[f"{m}.self_attn.k_proj.weight"].T).reshape(n, kv, d), pos, t["theta"])
    v = (x @ w[f"{m}.self_attn.v_proj.weight"].T).reshape(n, kv, d)
    o = np.zeros((n, heads, d))
    for h in range(heads):
        for i in range(n):
            s = k[:i + 1, h // (heads // kv)] @ q[i, h] / np.sqrt(d)
            a = np.exp(s - s.max())
            o[i, h] = (a / a.sum()) @ v[:i + 1, h // (heads // kv)]
    r = g + o.reshape(n, -1) @ w[f"{m}.self_attn.o_proj.weight"].T
    hh = rms(r, w[f"{m}.post_attention_layernorm.weight"], eps)
    gate = hh @ w[f"{m}.mlp.gate_proj.weight"].T
    up = hh @ w[f"{m}.mlp.up_proj.weight"].T
    return r + (gate / (1 + np.exp(-gate)) * up) @ w[f"{m}.mlp.down_proj.weight"].T


def logits(out, w, t):
    z = rms(out, w["norm.weight"], t["eps"]) @ w["lm_head.weight"].T
    full = np.full(t["vocab"], -np.inf)
    full[np.arange(len(z)) + w["d2t"].astype(np.int64)] = z
    return full


def propose(taps, tokens, bonus, n, w, t):
    g = list(taps @ w["fc.weight"].T)
    nxt = list(tokens[1:]) + [bonus]
    drafts, zs = [], []
    for _ in range(n):
        out = layer(np.array(g), np.array(nxt), np.arange(len(g), dtype=np.float64), w, t)[-1]
        z = logits(out, w, t)
        drafts.append(int(np.argmax(z)))
        zs.append(z)
        g.append(out)
        nxt.append(drafts[-1])
    return drafts, np.array(zs)
