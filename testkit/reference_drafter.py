"""Float64 NumPy reference of the DSpark drafter (docs/design.md §6), for tests only.

Written from the design text, not from mlx_dspark/drafter.py: it reads the checkpoint bytes
with its own safetensors parser and NVFP4/E4M3/BF16 decoders, keeps *all* context (the
sliding window is applied by the mask alone, never by truncating a cache), and loops over
heads and queries in the plainest way. Stateless: every call recomputes from the full tap
history.
"""

from __future__ import annotations

import json
import os

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = np.concatenate([E2M1, -E2M1])


def e4m3(byte: np.ndarray) -> np.ndarray:
    """OCP E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    byte = byte.astype(np.int64)
    sign = np.where(byte >> 7, -1.0, 1.0)
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    return sign * mag


def read_safetensors(path: str) -> dict:
    """name -> numpy array in the stored dtype (BF16 as float64 values)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    kinds = {"U8": np.uint8, "U32": np.uint32, "F32": np.float32, "F16": np.float16,
             "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        x = np.frombuffer(body[a:b], dtype=kinds[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        out[name] = x
    return out


def dense_weight(t: dict, prefix: str) -> np.ndarray:
    """The float64 ``(out, in)`` weight of a linear module in the converted layout."""
    if f"{prefix}.scales" in t:
        codes = t[f"{prefix}.weight"]                      # uint32 (out, in/8)
        by = codes.astype("<u4").view(np.uint8)            # little-endian bytes
        nib = np.empty(by.shape[:-1] + (by.shape[-1] * 2,), dtype=np.int64)
        nib[..., 0::2] = by & 0xF                          # element 2j: low nibble of byte j
        nib[..., 1::2] = by >> 4
        block = np.repeat(e4m3(t[f"{prefix}.scales"]), 16, axis=-1)
        return E2M1[nib] * block * float(t[f"{prefix}.weight_scale_2"])
    return np.asarray(t[f"{prefix}.weight"], dtype=np.float64)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE over the full last axis; ``x [T, D]``, ``pos [T]``."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)
    rot = np.concatenate([-x[:, d // 2:], x[:, :d // 2]], axis=-1)
    return x * cos + rot * sin


def attend(q, keys, values, q_pos, k_pos, window, sink, scale):
    """One head: softmax over visible keys with ``exp(sink)`` added to the denominator."""
    out = np.zeros_like(q)
    for i in range(q.shape[0]):
        vis = [j for j in range(len(k_pos))
               if k_pos[j] <= q_pos[i] and (window is None or k_pos[j] > q_pos[i] - window)]
        s = np.array([q[i] @ keys[j] for j in vis]) * scale
        top = max(s.max(), sink if sink is not None else -np.inf)
        e = np.exp(s - top)
        den = e.sum() + (np.exp(sink - top) if sink is not None else 0.0)
        out[i] = (e[:, None] * values[vis]).sum(0) / den
    return out


class ReferenceDrafter:
    def __init__(self, drafter_dir: str, embed: np.ndarray, lm_head: np.ndarray):
        """``embed``/``lm_head``: the target's float64 ``[V, hidden]`` matrices."""
        self.c = json.load(open(os.path.join(drafter_dir, "config.json")))
        self.t = {}
        for f in sorted(os.listdir(drafter_dir)):
            if f.endswith(".safetensors"):
                self.t.update(read_safetensors(os.path.join(drafter_dir, f)))
        self.embed, self.lm_head = embed, lm_head
        c = self.c
        self.heads, self.kv, self.hd = (c["num_attention_heads"], c["num_key_value_heads"],
                                        c["head_dim"])
        self.window = c["sliding_window"] if c["layer_types"][0] == "sliding_attention" else None
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        self.W = {k[:-len(".weight")]: dense_weight(self.t, k[:-len(".weight")])
                  for k in self.t if k.endswith(".weight")}

    def _layer_kv(self, i, x, pos):
        p = f"layers.{i}.self_attn"
        k = (x @ self.W[f"{p}.k_proj"].T).reshape(len(pos), self.kv, self.hd)
        v = (x @ self.W[f"{p}.v_proj"].T).reshape(len(pos), self.kv, self.hd)
        k = np.stack([rope(rmsnorm(k[:, h], self.W[f"{p}.k_norm"], self.eps), pos, self.theta)
                      for h in range(self.kv)], axis=1)
        return k, v

    def block_logits(self, taps: np.ndarray, bonus: int, n: int) -> np.ndarray:
        """``U [n, V]`` for the block ``[bonus, mask x n]`` after context ``taps [P, ...]``."""
        P = taps.shape[0]
        ctx = rmsnorm(taps @ self.W["fc"].T, self.W["hidden_norm"], self.eps)
        ctx_pos = np.arange(P, dtype=np.float64)
        blk_pos = np.arange(P, P + n + 1, dtype=np.float64)
        ids = [bonus] + [self.c["mask_token_id"]] * n
        # The drafter's own embed_tokens when it has one (the runtime may substitute the
        # target's when the two are bit-identical, which changes nothing here).
        x = self.t.get("embed_tokens.weight", self.embed)[ids]
        group = self.heads // self.kv
        for i in range(self.c["num_hidden_layers"]):
            p = f"layers.{i}"
            ck, cv = self._layer_kv(i, ctx, ctx_pos)              # no input_layernorm on context
            a = rmsnorm(x, self.W[f"{p}.input_layernorm"], self.eps)
            bk, bv = self._layer_kv(i, a, blk_pos)
            keys, vals = np.concatenate([ck, bk]), np.concatenate([cv, bv])
            k_pos = np.concatenate([ctx_pos, blk_pos])
            q = (a @ self.W[f"{p}.self_attn.q_proj"].T).reshape(n + 1, self.heads, self.hd)
            sinks = self.t.get(f"{p}.self_attn.attention_sink_bias")
            o = np.zeros_like(q)
            for h in range(self.heads):
                qh = rope(rmsnorm(q[:, h], self.W[f"{p}.self_attn.q_norm"], self.eps), blk_pos,
                          self.theta)
                o[:, h] = attend(qh, keys[:, h // group], vals[:, h // group], blk_pos, k_pos,
                                 self.window, None if sinks is None else sinks[h], self.hd ** -0.5)
            x = x + o.reshape(n + 1, -1) @ self.W[f"{p}.self_attn.o_proj"].T
            m = rmsnorm(x, self.W[f"{p}.post_attention_layernorm"], self.eps)
            g = m @ self.W[f"{p}.mlp.gate_proj"].T
            u = m @ self.W[f"{p}.mlp.up_proj"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ self.W[f"{p}.mlp.down_proj"].T
        h = rmsnorm(x, self.W["norm"], self.eps)[1:]
        return h @ self.lm_head.T

    def markov_bias(self, prev: int) -> np.ndarray:
        return self.W["markov_head.markov_w2"] @ self.t["markov_head.markov_w1.weight"][prev]

    def propose(self, taps, bonus, n, tokens=None):
        """``(tokens, z [n, V])``. Greedy (argmax chain) unless ``tokens`` is given, in which
        case those are the previous tokens of the chain (to check sampled proposals)."""
        u = self.block_logits(taps, bonus, n)
        prev, out, zs = bonus, [], []
        for j in range(n):
            z = u[j] + self.markov_bias(prev)
            prev = int(np.argmax(z)) if tokens is None else int(tokens[j])
            out.append(prev)
            zs.append(z)
        return np.array(out), np.stack(zs)


def assert_proposals_match(target, drafter, reference, tol: float):
    """The drafter against its float64 ``reference`` on the target's real taps: a 19-token
    prompt (past the drafters' windows) taken in as context in two pieces, then proposals of
    1..7 tokens after a bonus: the same tokens, logits within ``tol`` of the reference's scale."""
    import mlx.core as mx
    prompt = mx.array([[(37 * i + 11) % 256 for i in range(19)]])
    _, taps = target.step(prompt, target.make_cache(), tap_layers=drafter.target_layer_ids)
    drafter.add_context(taps[:12], 0)
    drafter.add_context(taps[12:], 12)
    history = np.array(taps, dtype=np.float64)
    for n in range(1, 8):
        tokens, z = drafter.propose(200 + n, n)
        want_tokens, want_z = reference.propose(history, 200 + n, n)
        assert np.array(tokens).tolist() == want_tokens.tolist()
        assert float(np.abs(np.array(z) - want_z).max() / np.abs(want_z).max()) < tol
