"""Teacher-forced copy on held-out agent calls (issue 41, item 4): on the first 12 calls of
agent_data's held-out split, for each argument piece the request holds (tune_tools.copy_sources),
the attention layer's mass on the request's copies (the best head) and whether the model's
argmax is that piece; split into a name's first copied piece (where session 17's tunes failed)
and the pieces after it. Weights rounded as the export rounds them.

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/copy_probe.py [--mirror-names] CKPT...

With ``--ask TEXT...``: for each request, sent by each agent, where the attention layer's head
with the most mass on the request looks (its top 4 pieces there) when the read's file name
starts (after Codex's ``cat``, after opencode's ``filePath``), and the model's top 3 next pieces.
"""
import argparse

import torch
from torch.nn.utils import parametrize

import agent_data
import chat_data
import nvfp4_qat
import tune_tools
from common import THREADS
from export_target import load_dequantized
from testkit import agent_turns

CALLS = 12
READ_OPENINGS = {"codex": "<tool_call>\n<function=exec_command>\n<parameter=cmd>\ncat",
                 "opencode": "<tool_call>\n<function=read>\n<parameter=filePath>\n"}


def probe(model) -> str:
    first, later = [], []      # (mass, right) per copied piece
    with torch.no_grad(), parametrize.cached():
        for i in range(CALLS):
            prompt, reply = agent_data.example("heldout", i, None, "call")
            kept = []
            hook = tune_tools.keep_attention_inputs(model, kept)
            logits = model(torch.tensor([prompt + reply])).logits[0]
            hook.remove()
            where = tune_tools.value_positions(reply)
            queries = [len(prompt) + j - 1 for j in where]
            sources = tune_tools.copy_sources(prompt, agent_data.last_turn_start(prompt), [reply[j] for j in where])
            probs = tune_tools.attention_probs(model, kept[0][0], queries)
            for n, (j, s) in enumerate(zip(where, sources)):
                if s:
                    row = (probs[:, n, s].sum(-1).max().item(), logits[queries[n]].argmax().item() == reply[j])
                    (first if n == 0 or not sources[n - 1] else later).append(row)

    def show(rows):
        return f"mass {sum(m for m, _ in rows) / max(len(rows), 1):.3f}, argmax right {sum(r for _, r in rows)}/{len(rows)}"
    return f"first copied piece: {show(first)}; later pieces: {show(later)}"


def where(model, asks) -> list[str]:
    tok = chat_data.tokenizer()
    out = []
    with torch.no_grad(), parametrize.cached():
        for ask in asks:
            for agent, opening in READ_OPENINGS.items():
                prompt = agent_data.render(agent, agent_turns.body_of(agent, ask, agent_turns.CWD))
                ids = prompt + tok.encode(opening, add_special_tokens=False)
                kept = []
                hook = tune_tools.keep_attention_inputs(model, kept)
                logits = model(torch.tensor([ids])).logits[0, -1]
                hook.remove()
                start = agent_data.last_turn_start(prompt)
                probs = tune_tools.attention_probs(model, kept[0][0], [len(ids) - 1])[:, 0, start:len(prompt)]
                head = probs.sum(-1).argmax()
                top = probs[head].topk(4)
                pieces = tok.convert_ids_to_tokens(prompt[start:])
                looks = ", ".join(f"{pieces[i]!r} {v:.2f}" for v, i in zip(top.values.tolist(), top.indices.tolist()))
                out.append(f"  {agent:8s} {ask!r}: head {head.item()} looks at {looks}; "
                           f"next {tok.convert_ids_to_tokens(logits.topk(3).indices.tolist())}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--mirror-names", action="store_true", help="calls spelt as tune_tools --mirror-names spells them")
    ap.add_argument("--ask", nargs="*", help="requests: where the copy looks as a read's name starts")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    agent_data.MIRROR_NAMES = args.mirror_names
    for ckpt in args.ckpts:
        model = load_dequantized()
        model.load_state_dict(torch.load(ckpt)["model"])
        nvfp4_qat.enable(model.eval())
        print(f"{ckpt}: " + ("\n".join(where(model, args.ask)) if args.ask else probe(model)), flush=True)


if __name__ == "__main__":
    main()
