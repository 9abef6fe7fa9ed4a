"""Tiny real models for the loop, controller and API tests: our Nemotron-H target with random
weights (built like the target tests build it) and a DSpark drafter with random weights (a
useless drafter: its acceptance is near 1/vocab)."""

from __future__ import annotations

import mlx.core as mx

from mlx_dspark import drafter as D
from mlx_dspark.controller import Controller
from mlx_dspark.speculative import decode
from mlx_dspark.target import NemotronH, TargetConfig
from target_helpers import hf_weights_from_mlx_lm, random_mlx_lm_model, tiny_config


def tiny_target(seed=0, dtype=mx.float32, **over) -> NemotronH:
    cfg = tiny_config(**over)
    return NemotronH(TargetConfig.from_dict(cfg),
                     hf_weights_from_mlx_lm(random_mlx_lm_model(cfg, seed), stacked=True), dtype)


def random_drafter(target, seed=0, layers=2, window=16, tap_layers=(0, 2)) -> D.Drafter:
    """NVIDIA's drafter layout at toy size, every weight random (dense float32)."""
    tc = target.config
    cfg = D.DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=tc.vocab_size, rms_norm_eps=1e-6,
        rope_theta=10000.0, windows=(window,) * layers, attention_sinks=True, block_size=8,
        mask_token_id=tc.vocab_size - 1, target_layer_ids=tuple(tap_layers),
        target_hidden_size=tc.hidden_size, markov_rank=8,
        has_embed_tokens=False)
    mx.random.seed(seed)
    w = {}
    for name, shape in D._expected_plain(cfg).items():
        w[name] = (1.0 + 0.1 * mx.random.normal(shape)) if name.endswith("norm.weight") \
            else mx.random.normal(shape) * 0.3
    for prefix, (out, inp) in D._expected_linears(cfg).items():
        w[prefix + ".weight"] = mx.random.normal((out, inp)) * inp ** -0.5
    drafter = D.Drafter(cfg, w, target, mx.float32, share_embedding=True)
    mx.eval(drafter.parameters())
    return drafter


def serial_greedy(target, prompt, max_tokens) -> list[int]:
    return list(decode(target, None, prompt, max_tokens=max_tokens, speculative=False))


def top2_gap(target, tokens) -> float:
    """Gap between the target's two largest logits after ``tokens`` (full forward)."""
    logits = target(mx.array([tokens]))[0, -1]
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0]


class FixedCosts(Controller):
    """The real controller with the loop's wall times replaced by fixed costs (a serial step
    costs 1, a round ``round_cost``): its decisions then depend only on what the drafter
    accepts, never on the machine's load. Install it as ``session.controller`` (or
    ``pair.controller``) before decoding with the same num_draft and "auto"."""

    def __init__(self, num_draft: int, round_cost: float):
        super().__init__(num_draft)
        self.cost = round_cost

    def observe_serial(self, seconds: float):
        super().observe_serial(1.0)

    def observe_round(self, seconds, num_drafted, num_tested, num_accepted):
        super().observe_round(self.cost, num_drafted, num_tested, num_accepted)
