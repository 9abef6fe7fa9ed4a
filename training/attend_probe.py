"""Issue 41 diagnostic: can the choosing attention layer's queries and keys alone learn to look
at the right tool's description? Every parameter of a tune checkpoint is frozen except layer
3's ``q_proj`` and ``k_proj``, trained on tune_tools.attend_loss alone over hard-call batches
(random names, 2-4 tools of different actions); prints the loss and the mean attention mass on
the right tool's span every 10 steps (attending to every description alike gives about 0.39).

``--ends`` (session 14): the right span is only the end of the right tool's description
(action_probe.description_ends, where action_probe.py's read-out makes the action readable),
on action_probe.py's hard calls (vocabulary names, composed descriptions, 8 a batch).

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/attend_probe.py CKPT [--steps 300] [--lr 3e-3] [--ends]
"""
import argparse

import torch

import action_probe
import tool_data
import tune_tools
from export_target import load_dequantized


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ends", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tool_data.hard_call_options(args.ends, args.ends)
    tune_tools.CARRY_SPAN = "description"
    model = load_dequantized()
    model.load_state_dict(torch.load(args.ckpt)["model"])
    model.train()
    kept = tune_tools.attention_to_tool(model)
    mixer = model.model.layers[tune_tools.CARRY_LAYER].mixer
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [mixer.q_proj.weight, mixer.k_proj.weight]
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trained, lr=args.lr)
    first = 10.0 if args.ends else 30.0    # the copy weight that marks the name's first token (copy_weights)
    for step in range(args.steps):
        ids, labels, weights, carry = (tune_tools.hard_answers(step, 4, 8, 8, 0, 0, first) if args.ends
                                       else tune_tools.hard_answers(step, 4, 8, 7, 1, 0, first))
        if args.ends:
            carry = action_probe.description_ends(action_probe.batch_targets(ids), carry)
        kept.clear()
        model(ids[:, :-1])
        loss, mass = tune_tools.attend_loss(kept[-1], carry[:, :-1], labels[:, 1:], weights[:, 1:] == first)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(step, round(loss.item(), 3), round(mass, 3), flush=True)


if __name__ == "__main__":
    main()
