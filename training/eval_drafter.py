"""Step 5c: greedy acceptance of the packed drafter against the exported target, in PyTorch.

Both models hold exactly the shipped weights (NVFP4 tensors dequantized by ModelOpt). For each
held-out prompt the target decodes greedily; speculative rounds are then replayed on that
output (greedy speculation is lossless, so the round boundaries are fully determined): the
bonus sits at P with the taps of positions < P as context, the drafter proposes N tokens
(Markov head fed its own drafts), a = number of leading drafts equal to the target's argmax,
and the next round starts at P + a + 1. Reports tokens per round (a + 1) and per-position
conditional acceptance, for the code prompts, the text prompts and held-out corpus snippets.

    /work/venv-fx/bin/python training/eval_drafter.py [--max-new 64]
"""
import argparse
import json

import torch
from transformers import AutoTokenizer

from common import THREADS, tokens
from data import HERE, WORK
from drafter_io import load_packed_drafter, target_taps
from drafter_model import block_mask
from export_target import load_dequantized


@torch.no_grad()
def greedy(target, ids, max_new):
    seq = list(ids)
    for _ in range(max_new):
        logits = target(torch.tensor([seq]), use_cache=False).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq


@torch.no_grad()
def propose(drafter, target, taps, bonus, P, n):
    """Greedy drafts d1..dn for the block anchored at P (context: taps of positions < P)."""
    ctx_pos = torch.arange(P)
    row_pos, mask = block_mask(ctx_pos, torch.tensor([P]), n, drafter.c.sliding_window)
    block = torch.tensor([[bonus] + [drafter.c.mask_token_id] * n])
    hid = drafter.block_hidden(block, row_pos, drafter.context(taps[:, :P], ctx_pos), mask)[0, 1:]
    u = target.lm_head(hid)
    prev, out = bonus, []
    for j in range(n):
        z = u[j] + drafter.markov_head(torch.tensor([prev]))[0]
        prev = int(z.argmax())
        out.append(prev)
    return out


@torch.no_grad()
def replay_rounds(drafter, target, seq, n_prompt, n):
    """(accepted-per-round list) for greedy speculation over the target's own output seq."""
    taps, _ = target_taps(target, torch.tensor([seq]))
    P, accepted = n_prompt, []          # first bonus: the first generated token, at n_prompt
    while P + n < len(seq):
        drafts = propose(drafter, target, taps, seq[P], P, n)
        a = 0
        while a < n and drafts[a] == seq[P + 1 + a]:
            a += 1
        accepted.append(a)
        P += a + 1
    return accepted


def summarize(accepted, n):
    rounds = len(accepted)
    tested = [sum(1 for a in accepted if a >= j) for j in range(n)]        # rounds reaching position j+1
    passed = [sum(1 for a in accepted if a >= j + 1) for j in range(n)]
    return {
        "rounds": rounds,
        "mean_tokens_per_round": sum(a + 1 for a in accepted) / max(1, rounds),
        "acceptance_by_position": [p / t if t else None for p, t in zip(passed, tested)],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--snippets", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    target = load_dequantized()
    drafter = load_packed_drafter()
    tok = AutoTokenizer.from_pretrained(WORK / "tokenizer" / "hf")
    prompts = json.loads((HERE / "prompts.json").read_text())
    held = tokens("heldout")
    snippets = [held[i * len(held) // args.snippets:][:48].tolist() for i in range(args.snippets)]
    report = {}
    for group, items in (("code", [tok.encode(p) for p in prompts["code"]]),
                         ("text", [tok.encode(p) for p in prompts["text"]]),
                         ("heldout_corpus", snippets)):
        acc = []
        for ids in items:
            seq = greedy(target, ids, args.max_new)
            acc += replay_rounds(drafter, target, seq, len(ids), args.num_draft)
            if group == "code" and ids == items[0]:
                report["sample"] = tok.decode(seq)
        report[group] = summarize(acc, args.num_draft)
        print(group, json.dumps(report[group]), flush=True)
    print(report["sample"])
    (WORK / "drafter_eval.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
