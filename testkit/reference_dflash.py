"""Float64 NumPy reference of z-lab's DFlash drafter (``DFlashDraftModel`` in z-lab's
``dflash/model.py``), for tests only.

Written from z-lab's definition, not from mlx_dspark/drafters/dflash.py: it reads the raw
``config.json`` fields itself, keeps *all* context (the sliding window is applied by the mask
alone, never by cutting a cache), and computes every head and query in the plainest way.
Stateless: every call recomputes from the full tap history.

z-lab's forward, per block anchored at P (the bonus' position; context = the taps of 0..P-1):
  target_hidden = hidden_norm(fc(taps))
  x = embed([bonus, mask x (B-1)]) * input_embedding_scale            positions P..P+B-1
  per layer:  h = input_layernorm(x)
              q = q_norm(q_proj h);  k = k_norm(k_proj [target_hidden; h]);  v = v_proj [...]
              RoPE (rotate-half) at each row's position; GQA softmax(q k^T / sqrt(d)) v with
              the mask below; x += o_proj(.);  x += mlp(post_attention_layernorm x)
  logits = lm_head(norm(x))[1:] * output_multiplier, tanh-capped by final_logit_softcapping
Mask (z-lab's ``_attention_mask``): a layer is causal if ``is_causal`` says so, else if it is
a sliding layer; causal: key <= query; sliding window W: query - key < W, and when not causal
also key - query < W.
"""

from __future__ import annotations

import numpy as np


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [T, D] at positions pos [T], rotate-half over the full head dim."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[:, d // 2:], x[:, :d // 2]], -1)
    return x * cos + rot * sin


def value(cfg, name, default=None):
    """z-lab's ``_draft_value``: dflash_config first, then the top level."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


class ReferenceDFlash:
    """``weights``: name -> float64 array (dense ``(out, in)`` linears, z-lab's names);
    ``embed`` and ``lm_head``: the target's, float64."""

    def __init__(self, cfg: dict, weights: dict, embed: np.ndarray, lm_head: np.ndarray):
        self.c, self.w, self.embed, self.lm_head = cfg, weights, embed, lm_head
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.block = int(value(cfg, "block_size", 16))
        self.mask_id = int(value(cfg, "mask_token_id"))
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.heads

    def _layer_mask(self, i, q_pos, k_pos):
        c = self.c
        types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        sliding = types[i] == "sliding_attention"
        causal = c.get("is_causal")
        causal = sliding if causal is None else bool(causal)
        window = c["sliding_window"] if sliding else None
        q, k = q_pos[:, None], k_pos[None, :]
        visible = np.ones((len(q_pos), len(k_pos)), bool)
        if causal:
            visible &= k <= q
        if window is not None:
            visible &= q - k < window
            if not causal:
                visible &= k - q < window
        return visible

    def logits(self, taps: np.ndarray, bonus: int) -> np.ndarray:
        """Rows 1..B-1 of the block after ``bonus`` with context ``taps [P, n*h]``: [B-1, V]."""
        w, eps, hd = self.w, self.eps, self.hd
        P, B = taps.shape[0], self.block
        ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        ids = [bonus] + [self.mask_id] * (B - 1)
        x = self.embed[ids] * float(value(self.c, "input_embedding_scale", 1.0))
        q_pos = np.arange(P, P + B)
        k_pos = np.arange(P + B)
        theta = self.c.get("rope_theta", 10000.0)
        for i in range(self.c["num_hidden_layers"]):
            p = f"layers.{i}"
            h = rms(x, w[f"{p}.input_layernorm.weight"], eps)
            both = np.concatenate([ctx, h])
            q = h @ w[f"{p}.self_attn.q_proj.weight"].T
            k = both @ w[f"{p}.self_attn.k_proj.weight"].T
            v = both @ w[f"{p}.self_attn.v_proj.weight"].T
            mask = self._layer_mask(i, q_pos, k_pos)
            out = np.zeros((B, self.heads * hd))
            for head in range(self.heads):
                g = head // (self.heads // self.kv)
                qh = rope(rms(q[:, head * hd:(head + 1) * hd], w[f"{p}.self_attn.q_norm.weight"], eps),
                          q_pos, theta)
                kh = rope(rms(k[:, g * hd:(g + 1) * hd], w[f"{p}.self_attn.k_norm.weight"], eps),
                          k_pos, theta)
                s = qh @ kh.T / np.sqrt(hd)
                s = np.where(mask, s, -np.inf)
                a = np.exp(s - s.max(-1, keepdims=True))
                a /= a.sum(-1, keepdims=True)
                out[:, head * hd:(head + 1) * hd] = a @ v[:, g * hd:(g + 1) * hd]
            x = x + out @ w[f"{p}.self_attn.o_proj.weight"].T
            f = rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
            gate = f @ w[f"{p}.mlp.gate_proj.weight"].T
            up = f @ w[f"{p}.mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"].T
        z = rms(x, w["norm.weight"], eps)[1:] @ self.lm_head.T
        z = z * float(value(self.c, "output_multiplier", 1.0))
        cap = value(self.c, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            z = np.tanh(z / cap) * cap
        return z

    def propose(self, taps, bonus, n):
        """Greedy drafts and their logits: the first ``n`` rows of the block."""
        z = self.logits(taps, bonus)[:n]
        return z.argmax(-1), z
