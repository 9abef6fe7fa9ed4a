"""The DSpark drafter in PyTorch, for training (design.md §6). Parameter names are NVIDIA's tensor
names (no `model.` prefix), so the state dict is the checkpoint.

Math, per block anchored at position P (the bonus token's position; the context is the target
taps of positions < P):
  context   c_p = hidden_norm(fc(taps_p));  per layer K = RoPE_p(k_norm(W_k c_p)), V = W_v c_p
            (no input_layernorm on this path; the context never runs through the layers)
  block     rows [bonus, mask x N] at positions P..P+N, embedded with the target's embedding;
            each layer: pre-norm, q/k per-head RMSNorm before RoPE (rotate-half, full head_dim),
            GQA attention, causal, sliding window of `window` keys including itself, a per-head
            sink adding exp(sink_h) to the softmax denominator, o_proj; SwiGLU MLP; final norm
  logits    row j (1..N): U_j = lm_head_target(h_j);  z_j = U_j + W2 W1[prev_j], where prev_1 is
            the bonus and prev_j (j > 1) the token at position P+j-1.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list
    sliding_window: int
    markov_rank: int
    mask_token_id: int
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope(x, pos, theta):
    """Rotate-half RoPE over the full head dim. x [..., T, D], pos [T] (absolute positions)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.c = c
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)
        self.attention_sink_bias = nn.Parameter(torch.zeros(c.num_attention_heads))

    def keys_values(self, x, pos):
        """K (normed, rotated) and V for inputs x [B, T, h] at positions pos [T]."""
        c = self.c
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rope(k, pos, c.rope_theta), v

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        """x [B, R, h] block rows at pos [R]; ctx_k/v [B, kvh, C, d]; mask [R, C+R] bool (True = attend)."""
        c = self.c
        B, R, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, R, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        q = rope(q, pos, c.rope_theta)
        k, v = self.keys_values(x, pos)
        k = torch.cat([ctx_k, k], 2)
        v = torch.cat([ctx_v, v], 2)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        s = s.masked_fill(~mask, float("-inf"))
        # The sink is one more logit per head with no value: it only grows the denominator.
        sink = self.attention_sink_bias.view(1, -1, 1, 1).expand(B, -1, R, 1).to(s.dtype)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        o = (p @ v).transpose(1, 2).reshape(B, R, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


class MarkovHead(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.vocab_size, bias=False)

    def forward(self, prev):
        return self.markov_w2(self.markov_w1(prev))


class DSparkDrafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)  # the target's, frozen
        self.fc = nn.Linear(len(c.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.markov_head = MarkovHead(c)

    def context(self, taps, pos):
        """Per layer (K, V) of the context: taps [B, C, n*h] at positions pos [C]."""
        cx = self.hidden_norm(self.fc(taps))
        return [layer.self_attn.keys_values(cx, pos) for layer in self.layers]

    def block_hidden(self, block_ids, block_pos, ctx_kv, mask):
        """Final-normed hidden states of the block rows: block_ids [B, R], block_pos [R]."""
        x = self.embed_tokens(block_ids)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = x + layer.self_attn(layer.input_layernorm(x), block_pos, ck, cv, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def block_mask(ctx_pos, anchors, n, window):
    """Attention mask for many blocks in one pass.

    Rows: for each anchor P (the bonus position) the block [bonus, mask x n] at positions P..P+n.
    Keys: the context positions ctx_pos [C], then every block row. A row at position P+j sees
    context positions < P, block rows of its own block at offsets <= j, and only keys within
    `window` positions of itself (including itself).
    Returns (row_pos [A*(n+1)], mask [A*(n+1), C + A*(n+1)]).
    """
    A, R = len(anchors), n + 1
    offs = torch.arange(R)
    row_anchor = anchors.repeat_interleave(R)
    row_off = offs.repeat(A)
    row_pos = row_anchor + row_off
    ctx = (ctx_pos[None, :] < row_anchor[:, None]) & (row_pos[:, None] - ctx_pos[None, :] < window)
    same = row_anchor[:, None] == row_anchor[None, :]
    blk = same & (row_off[None, :] <= row_off[:, None]) & (row_off[:, None] - row_off[None, :] < window)
    return row_pos, torch.cat([ctx, blk], 1)
