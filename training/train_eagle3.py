"""Step 9: an EAGLE-3 head for the demo target, in SpecForge's layout (``LlamaForCausalLMEagle3``).

The head vLLM's ``llama_eagle3`` defines and mlx_dspark/eagle3.py runs: ``fc`` over the taps of
target layers 1, 3, 5 (``eagle_aux_hidden_state_layer_ids`` [2, 4, 6]), one Llama decoder layer
over ``[input_layernorm(embed(t_{p+1})) ; hidden_norm(g_p)]`` (4 heads x 48, 2 KV heads, RoPE
10000, SwiGLU 512), ``norm`` and an ``lm_head`` over the full vocabulary (``d2t`` all zero); the
embedding is the target's (not saved: the runtime borrows it). Features and objective as for
the MTP block (train_mtp.py: the MLX runtime's taps, the target's own next-next-token
distribution), trained over K drafting steps (``--ttt``, training-time test: steps after the
first take the layer's own output, as drafting does, train_mtp.unroll); ``lm_head`` starts from
the target's, ``norm`` from ``norm_f`` (or all from an exported head, ``--init``). ``--text``
adds that many greedy windows of the ``text`` kind (the target continuing a few English words,
greedy_windows.py) to the mix.

    TRAIN_THREADS=1 .venv-train/bin/python training/train_eagle3.py --ttt 3 --steps 700 --windows 192
    mlx-dspark convert training/work/eagle3_export -o mlx_dspark/demo/eagle3
"""
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from data import WORK
from train_mtp import SEED, arguments, features, fit, held_out, rms, start_from, training_windows

TAPS = [1, 3, 5]
HEADS, KV, HD, INTER = 4, 2, 48, 512
OUT = WORK / "eagle3_export"


def rope(x, pos0=0, theta=10000.0):
    """x [B, heads, T, d] at positions pos0..pos0+T-1 (rotate-half)."""
    d, t = x.shape[-1], x.shape[-2]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(pos0, pos0 + t, dtype=torch.float32)[:, None] * freq[None]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


class Eagle3(torch.nn.Module):
    def __init__(self, target):
        super().__init__()
        import mlx.core as mx
        h = target.config.hidden_size
        g = torch.Generator().manual_seed(SEED)

        def arr(x):
            return torch.tensor(np.array(x.astype(mx.float32)))

        def lin(out, inp):
            return torch.nn.Parameter(torch.randn(out, inp, generator=g) * inp ** -0.5)

        P = torch.nn.Parameter
        self.fc = lin(h, len(TAPS) * h)
        self.input_layernorm, self.hidden_norm = P(torch.ones(h)), P(torch.ones(h))
        self.post_attention_layernorm = P(torch.ones(h))
        self.q, self.k, self.v = lin(HEADS * HD, 2 * h), lin(KV * HD, 2 * h), lin(KV * HD, 2 * h)
        self.o = P(torch.zeros(h, HEADS * HD))
        self.gate, self.up = lin(INTER, h), lin(INTER, h)
        self.down = P(torch.zeros(h, INTER))
        self.norm = P(arr(target.norm_f))
        head = target.head
        self.lm_head = P(arr(head.weight if not hasattr(head, "dequantized") else head.dequantized()))
        self.embed = arr(target.embeddings)

    def first(self, taps):
        """Step 1's ``g``: fc over the target's taps (later steps get the layer's output)."""
        return taps @ self.fc.T

    def qkv(self, next_ids, g, pos0):
        """The rows ``(g, x)`` and their attention's q, k, v (RoPE at positions pos0..;
        K/V repeated over the query heads)."""
        b, n, _ = g.shape
        x = torch.cat([rms(self.embed[next_ids], self.input_layernorm, 1e-6),
                       rms(g, self.hidden_norm, 1e-6)], -1)
        q = rope((x @ self.q.T).view(b, n, HEADS, HD).transpose(1, 2), pos0)
        k = rope((x @ self.k.T).view(b, n, KV, HD).transpose(1, 2), pos0)
        v = (x @ self.v.T).view(b, n, KV, HD).transpose(1, 2)
        rep = HEADS // KV
        return g, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, g, o):
        """-> (``out``: the next step's ``g``, before ``norm``; the logits)."""
        b, n, _ = g.shape
        r = g + o.transpose(1, 2).reshape(b, n, -1) @ self.o.T
        m = rms(r, self.post_attention_layernorm, 1e-6)
        out = r + (F.silu(m @ self.gate.T) * (m @ self.up.T)) @ self.down.T
        return out, rms(out, self.norm, 1e-6) @ self.lm_head.T

    def named(self) -> dict:
        """The head's tensors by their export names (SpecForge's)."""
        m = "midlayer"
        return {"fc.weight": self.fc, f"{m}.input_layernorm.weight": self.input_layernorm,
                f"{m}.hidden_norm.weight": self.hidden_norm,
                f"{m}.post_attention_layernorm.weight": self.post_attention_layernorm,
                f"{m}.self_attn.q_proj.weight": self.q, f"{m}.self_attn.k_proj.weight": self.k,
                f"{m}.self_attn.v_proj.weight": self.v, f"{m}.self_attn.o_proj.weight": self.o,
                f"{m}.mlp.gate_proj.weight": self.gate, f"{m}.mlp.up_proj.weight": self.up,
                f"{m}.mlp.down_proj.weight": self.down, "norm.weight": self.norm,
                "lm_head.weight": self.lm_head}

    def export(self, vocab: int, hidden: int):
        t = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.named().items()}
        t["d2t"] = torch.zeros(vocab, dtype=torch.int64)
        t["t2d"] = torch.ones(vocab, dtype=torch.bool)
        OUT.mkdir(parents=True, exist_ok=True)
        save_file(t, OUT / "model.safetensors", metadata={"format": "pt"})
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": INTER, "num_hidden_layers": 1,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
            "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "target_hidden_size": hidden,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in TAPS],
                             "use_aux_hidden_state": True},
            "mlx_dspark_demo": "mlx-dspark demonstration EAGLE-3 head for the demonstration "
                               "target; a demonstration model, not Nemotron",
        }
        (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"wrote {OUT}", flush=True)


def main():
    import greedy_windows

    args = arguments(__doc__, text=0)
    t0 = time.time()
    windows = training_windows(args.windows, "train")
    if args.text:
        windows += greedy_windows.windows("text", args.text, "train").tolist()
    ids, taps, top_p, top_i, target = features(windows, TAPS)
    held = held_out(TAPS)
    print(f"features: {len(windows)} + 16 held-out windows in {time.time() - t0:.0f} s", flush=True)
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    model = Eagle3(target)
    del target
    if args.init:
        start_from(model, args.init)
    fit(model, list(model.parameters()), args, (ids, taps, top_p, top_i), held, t0,
        lambda: model.export(vocab, hidden))


if __name__ == "__main__":
    main()
