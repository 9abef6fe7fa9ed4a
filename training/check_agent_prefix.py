"""Checks tune_tools.agent_loss's shared prefix on one checkpoint: two agent turns that share
their folder, the whole forward of the first against its shared prefix run once (no gradient)
and its rest continued from a copy of the prefix's cache; the largest logit difference on the
rest, and the time of each way with the backward pass.

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/check_agent_prefix.py CKPT
"""
import copy
import sys
import time

import torch

import agent_data
from common import THREADS
from export_target import load_dequantized


def main(ckpt):
    torch.set_num_threads(THREADS)
    model = load_dequantized()
    model.load_state_dict(torch.load(ckpt)["model"])
    model.train()
    cwd = agent_data.folder("check")
    (p0, r0), (p1, _) = (agent_data.example("train", i, cwd, "call") for i in (0, 2))
    n = agent_data.shared_prefix([p0, p1])
    ids = torch.tensor([p0 + r0])
    t = time.perf_counter()
    whole = model(ids[:, :-1]).logits
    whole[0, n:].sum().backward()
    t_whole = time.perf_counter() - t
    model.zero_grad()
    t = time.perf_counter()
    with torch.no_grad():
        cache = model(ids[:, :n], use_cache=True).past_key_values
    t_prefix = time.perf_counter() - t
    rest = model(ids[:, n:-1], past_key_values=copy.deepcopy(cache), use_cache=True).logits
    rest.sum().backward()
    t_shared = time.perf_counter() - t
    diff = (rest[0] - whole[0, n:]).abs().max().item()
    print(f"prompt {len(p0)} tokens, shared prefix {n}, rest {len(p0) + len(r0) - n}: "
          f"max |logit difference| {diff:.2e} (largest logit {whole.abs().max().item():.1f}); "
          f"forward and backward: whole {t_whole:.2f} s; the prefix (once for all an agent's turns "
          f"in a step) {t_prefix:.2f} s, then the rest {t_shared - t_prefix:.2f} s")
    assert diff < 1e-3, diff


if __name__ == "__main__":
    main(sys.argv[1])
