"""Issue 41 diagnostic (session 14): the choice of tool taken apart, read from a tune checkpoint's
attention layer (layer 3): what its input holds at the two ends of the choice, whether that is
enough to choose, and where the layer itself looks.

  request:  a linear read-out of the request's action (read / list / run / write) from the
            RMS-normalised input at the position that writes the name's first token;
  tool:     the same for each tool's action at its description's last token (``</``);
  bilinear: a rank-16 score between those two features, fitted on generated hard calls, picking
            among the offered tools (test split, then the 5 held-out requests, never fitted on);
  routing:  the layer's own attention (mean over heads) at the choosing position on each held-out
            tool's description end (its last word and ``</``); right when the called tool draws
            the most of it and at least 0.1 of the whole.

Hard calls are tool_data's (random vocabulary names, composed descriptions); read-outs fit on 3/4
of 40 batches, scored on the rest.

    PYTHONPATH=<testkit's parent>:training $FX training/choice_readouts.py CKPT [CKPT ...] [--rounded]
"""
import argparse

import torch
import torch.nn.functional as F

import action_probe
import chat_data
import nvfp4_qat
import tool_data
import tool_probe
import tune_tools
from export_target import load_dequantized

FIRST = 10.0    # the copy weight marking the name's first token (hard_answers' ``first``)


def features(model, seen, batches=40):
    """Per generated hard call: (choosing feature, called action, [tool end features], [tool
    actions], index of the called tool)."""
    rows = []
    with torch.no_grad():
        for step in range(batches):
            ids, labels, weights, carry = tune_tools.hard_answers(2 * 10**4 + step, 4, 8, 8, 0, 0, FIRST)
            seen.clear()
            model(ids[:, :-1])
            h = action_probe.rms(seen[-1])
            for r in range(ids.shape[0]):
                q = (weights[r, 1:] == FIRST).nonzero()[0, 0].item()
                act = action_probe.action_targets(ids[r].tolist())
                ends = action_probe.action_ends(act)
                right = [k for k, e in enumerate(ends) if carry[r, e - 1].item() == labels[r, q + 1].item()]
                if len(right) == 1:
                    rows.append((h[r, q], act[ends[right[0]]], torch.stack([h[r, e] for e in ends]),
                                 [act[e] for e in ends], right[0]))
    return rows


def linear(x, y):
    """Test accuracy of a 4-way linear read-out fitted on the first 3/4, and the majority share."""
    x, y = torch.stack(x), torch.tensor(y)
    n = len(y) * 3 // 4
    w = torch.nn.Linear(x.shape[1], 4)
    opt = torch.optim.Adam(w.parameters(), 1e-2, weight_decay=1e-3)
    for _ in range(500):
        opt.zero_grad()
        F.cross_entropy(w(x[:n]), y[:n]).backward()
        opt.step()
    return (w(x[n:]).argmax(-1) == y[n:]).float().mean().item(), torch.bincount(y[n:]).max().item() / len(y[n:])


def bilinear(rows):
    """A rank-16 score q U (K V)^T fitted on the first 3/4 to pick the called tool."""
    torch.manual_seed(0)
    n = len(rows) * 3 // 4
    u, v = (torch.nn.Parameter(torch.randn(rows[0][0].shape[0], 16) * 0.05) for _ in range(2))
    opt = torch.optim.Adam([u, v], 1e-2)
    for _ in range(300):
        loss = sum(F.cross_entropy(((q @ u) @ (k @ v).T)[None], torch.tensor([i])) for q, _, k, _, i in rows[:n]) / n
        opt.zero_grad()
        loss.backward()
        opt.step()
    test = rows[n:]
    right = sum(((q @ u) @ (k @ v).T).argmax().item() == i for q, _, k, _, i in test) / len(test)
    return u.detach(), v.detach(), right, sum(1 / len(k) for _, _, k, _, _ in test) / len(test)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--rounded", action="store_true", help="the weights as the export rounds them (nvfp4_qat.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tool_data.hard_call_options(vocab_names=True, composed=True)
    tune_tools.CARRY_SPAN = "description"
    head = len(chat_data.tokenizer().encode("<tool_call>\n<function=", add_special_tokens=False))
    for path in args.ckpts:
        model = load_dequantized()
        model.load_state_dict(torch.load(path)["model"])
        if args.rounded:
            nvfp4_qat.enable(model)
        model.eval()
        kept = tune_tools.attention_to_tool(model)
        seen = action_probe.layer_input(model)
        rows = features(model, seen)
        req = linear([r[0] for r in rows], [r[1] for r in rows])
        tool = linear([k for r in rows for k in r[2]], [a for r in rows for a in r[3]])
        u, v, right, chance = bilinear(rows)
        picked, routed = [], []
        with torch.no_grad():
            for p, r, name, _, names in tool_probe.heldout_examples():
                ids = p + r
                seen.clear()
                kept.clear()
                model(torch.tensor([ids]))
                h = action_probe.rms(seen[-1][0])
                ends = action_probe.action_ends(action_probe.action_targets(ids))
                q = len(p) + head - 1
                picked.append(names[((h[q] @ u) @ (h[ends] @ v).T).argmax().item()] == name)
                mass = [kept[-1][0].mean(0)[q, e - 1:e + 1].sum().item() for e in ends]
                k = names.index(name)      # right when it draws the most, and a tenth at least
                routed.append((name, mass[k] >= 0.1 and mass[k] > max(m for j, m in enumerate(mass) if j != k),
                               [round(m, 2) for m in mass]))
        print(f"{path}: request action {req[0]:.2f} (majority {req[1]:.2f}); tool action {tool[0]:.2f} "
              f"(majority {tool[1]:.2f}); bilinear pick {right:.2f} (chance {chance:.2f}), held-out "
              f"{sum(picked)}/5; the layer's own routing on held-out {sum(r[1] for r in routed)}/5 {routed}",
              flush=True)


if __name__ == "__main__":
    main()
