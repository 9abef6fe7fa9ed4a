"""Greedy calls of tune checkpoints on the agents' held-out requests (testkit's
AGENT_REQUESTS, or ``--ask`` phrasings sent by both agents), in PyTorch with the weights rounded
as the export rounds them (nvfp4_qat.py): the same calls the served check gets, in 30 s instead
of a candidate's export and a server.

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/agent_greedy.py CKPT... [--ask TEXT...]
"""
import argparse

import torch
from torch.nn.utils import parametrize

import agent_data
import chat_data
import nvfp4_qat
from common import THREADS
from export_target import load_dequantized
from testkit import agent_turns

MAX_TOKENS = 40


def greedy(model, ids):
    tok = chat_data.tokenizer()
    out = model(torch.tensor([ids]), use_cache=True)
    cache, nxt, reply = out.past_key_values, out.logits[0, -1].argmax().item(), []
    while nxt != tok.eos_token_id and len(reply) < MAX_TOKENS:
        reply.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[0, -1].argmax().item()
    return tok.decode(reply)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--ask", nargs="*", help="requests to send as both agents instead")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    rows = ([(a, ask, None, None) for ask in args.ask for a in agent_turns.AGENTS] if args.ask else
            [(a, ask, action, arg) for a, ask, action, arg, _ in agent_turns.AGENT_REQUESTS])
    for ckpt in args.ckpts:
        model = load_dequantized()
        model.load_state_dict(torch.load(ckpt)["model"])
        nvfp4_qat.enable(model.eval())
        right = 0
        with torch.no_grad(), parametrize.cached():
            for agent, ask, action, arg in rows:
                text = greedy(model, agent_data.render(agent, agent_turns.body_of(agent, ask, agent_turns.CWD)))
                ok = False
                if action:
                    name, want = agent_turns.call(agent, action, arg)
                    ok = f"<function={name}>" in text and f">\n{next(iter(want.values()))}\n</param" in text
                right += ok
                print(f"  {'right' if ok else '     '} {agent:8s} {ask!r:48s} {text[:100]!r}", flush=True)
        print(f"{ckpt}: right {right}/{len(rows)}" if not args.ask else ckpt, flush=True)


if __name__ == "__main__":
    main()
