"""Issue 41 experiment (session 14): does the choice of tool follow once the tokens of each
tool's description are made to say what the tool does?

Session 12 found that the choosing attention layer learns to look at the descriptions but not
at the right one: the description tokens do not separate "reads a file" from "writes one" in a
way the request's query can match. Here a linear read-out (``--action-weight``: a 4-way head on
the attention layer's input, RMS-normalised, at each tool's description tokens) asks those
tokens for the tool's action, beside tune_tools.py's carry loss (the tool's name at the same
tokens) and attend loss (the choosing position's attention mass on the right tool). From a tune
checkpoint, every row a hard call (randomly named tools, 2-4 of different actions); probes
every ``--probe-every`` steps: tool_probe.py's name1/offered/arg1 (held-out and generated), the
read-out's accuracy on the held-out tools' descriptions (never trained on), and the mass.

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/action_probe.py CKPT [--steps 400]
"""
import argparse
import functools
import itertools
import re

import torch
import torch.nn.functional as F

import chat_data
import tool_data
import tool_probe
import tune_tools
from export_target import load_dequantized
from testkit.demo_acts import HELDOUT_REQUESTS, HELDOUT_TOOLS

ACTIONS = ["read", "list", "run", "write"]
HELDOUT_ACTIONS = {"show_source": "read", "invoke": "run", "browse": "list", "slurp": "read",
                   "console_send": "run", "dump": "write"}


@functools.lru_cache(maxsize=None)
def description_actions() -> dict:
    """Every training tool description (listed, composed, the agents') -> its action; and the
    held-out ones, only ever measured."""
    out = {}
    for a in ACTIONS:
        for d in tool_data.DESCRIPTIONS[a] + tool_data.HARD_DESCRIPTIONS[a]:
            out[d] = a
        for v, o, t in itertools.product(tool_data.COMPOSED_VERBS[a], tool_data.COMPOSED_OBJECTS[a],
                                         tool_data.COMPOSED_TAILS[a]):
            out[f"{v} {o}{t}."] = a
    for agent in tool_data.AGENT_SETS:
        for a, t in agent.items():
            out[t["function"]["description"]] = a
    for tools in HELDOUT_TOOLS:
        for t in tools:
            out[t["function"]["description"]] = HELDOUT_ACTIONS[t["function"]["name"]]
    return out


def action_targets(ids):
    """-100, except on each tool's description (its words and the ``</`` that closes it), where
    the label is its action's index: the tokens that can know what the tool does."""
    tok = chat_data.tokenizer()
    carry = tune_tools.carry_targets(ids)
    out = [-100] * len(ids)
    j = 0
    while j < len(ids):
        if carry[j] == -100:
            j += 1
            continue
        k = j
        while k < len(ids) and carry[k] != -100:
            k += 1
        m = re.search(r"<description>(.*)", tok.decode(ids[j:k + 1]), re.S)
        desc = m and m.group(1).split("</")[0]
        if desc in description_actions():
            start = next(i for i in range(j, k) if tok.decode(ids[j:i + 1]).endswith("<description>"))
            out[start + 1:k + 1] = [ACTIONS.index(description_actions()[desc])] * (k - start)
        j = k
    return out


def query_targets(act, labels, weights, carry, first):
    """-100, except at the reply's positions up to the one choosing a tool (its name's first
    token weighted ``first``), where the label is the called tool's action (the action of the
    span carrying its name): what the choosing query needs to know."""
    out = torch.full(labels.shape, -100)
    for r, q in (weights == first).nonzero().tolist():
        span = ((carry[r] == labels[r, q]) & (act[r] != -100)).nonzero()
        start = (labels[r] != -100).nonzero()[0, 0].item() - 1
        if len(span):
            out[r, start:q + 1] = act[r, span[0, 0]]
    return out


def action_ends(act):
    """The positions of the ``</`` ending each labelled description (action_targets' labels)."""
    return [i for i in range(1, len(act) - 1) if act[i] != -100 and act[i + 1] == -100]


def batch_targets(ids):
    """action_targets of each row of a batch, as a tensor."""
    return torch.tensor([action_targets(row.tolist()) for row in ids])


def description_ends(act, carry):
    """carry_targets' labels (the tool's name's first token) kept only on the last word of each
    description and the ``</`` after it (``act``: batch_targets), where its action is readable
    (--attend-ends)."""
    out = torch.full(carry.shape, -100)
    for r in range(act.shape[0]):
        for e in action_ends(act[r].tolist()):
            out[r, e - 1:e + 1] = carry[r, e - 1]
    return out


def layer_input(model):
    """The choosing attention layer's input of each forward, kept in the returned list."""
    seen = []
    model.model.layers[tune_tools.CARRY_LAYER].register_forward_pre_hook(
        lambda m, a, kw: seen.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)
    return seen


def rms(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("init", help="a tune_tools.py checkpoint")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--action-weight", type=float, default=1.0)
    ap.add_argument("--query-weight", type=float, default=0.0,
                    help="a second read-out: the request's action at the choosing position")
    ap.add_argument("--carry-weight", type=float, default=0.5)
    ap.add_argument("--carry-head", action="store_true",
                    help="the carry loss through a trained linear read-out, not the fixed lens")
    ap.add_argument("--attend-weight", type=float, default=1.0)
    ap.add_argument("--attend-ends", action="store_true",
                    help="the attend loss's right span: only the end of the right tool's description")
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--vocab-names", action="store_true")
    ap.add_argument("--composed", action="store_true")
    ap.add_argument("--save", help="the model at the end ({'model': ...}, as tune_tools.py --init reads)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(4343)
    tool_data.hard_call_options(args.vocab_names, args.composed)
    tune_tools.CARRY_SPAN = "description"
    model = load_dequantized()
    model.load_state_dict(torch.load(args.init)["model"])
    kept = tune_tools.attention_to_tool(model)
    seen = layer_input(model)
    head = torch.nn.Linear(model.config.hidden_size, len(ACTIONS))
    qhead = torch.nn.Linear(model.config.hidden_size, len(ACTIONS))
    heads = [head, qhead]
    if args.carry_head:
        chead = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
        heads.append(chead)
    head_params = [p for h in heads for p in h.parameters()]
    opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": head_params, "lr": 3e-3}],
                            lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    probes = tool_probe.heldout_examples(), tool_probe.generated_examples(50)
    held_rows = [torch.tensor([p + r]) for p, r, *_ in probes[0]]
    first = 10.0
    for step in range(args.steps + 1):
        if step % args.probe_every == 0:
            line = tool_probe.report(model, probes)
            model.eval()
            with torch.no_grad():
                right = total = 0
                for ids in held_rows:
                    seen.clear()
                    model(ids)
                    act = torch.tensor(action_targets(ids[0].tolist()))
                    pred = head(rms(seen[-1][0])).argmax(-1)
                    right += (pred[act != -100] == act[act != -100]).sum().item()
                    total += (act != -100).sum().item()
            model.train()
            print(f"probe step {step}: {line} "
                  f"held-out description tokens read as their action {right}/{total}", flush=True)
        if step == args.steps:
            break
        ids, labels, weights, carry = tune_tools.hard_answers(step, 4, 8, 8, 0, 0, first)
        act = batch_targets(ids)
        seen.clear()
        log = []
        lens_carry = 0.0 if args.carry_head else args.carry_weight
        loss = tune_tools.weighted_answer_loss(model, ids, labels, weights, carry, lens_carry, log,
                                               0.0, first, kept, 0.0 if args.attend_ends else args.attend_weight)
        if args.attend_ends:
            att, mass = tune_tools.attend_loss(kept[-1], description_ends(act, carry)[:, :-1], labels[:, 1:],
                                               weights[:, 1:] == first)
            loss = loss + args.attend_weight * att
            log.append((att.item(), mass))
        if args.carry_head:
            cmask = carry[:, :-1] != -100
            clogits = chead(rms(seen[-1][cmask]))
            closs = F.cross_entropy(clogits, carry[:, :-1][cmask])
            loss = loss + args.carry_weight * closs
            log.append((closs.item(), (clogits.argmax(-1) == carry[:, :-1][cmask]).float().mean().item()))
        mask = act[:, :-1] != -100
        logits = head(rms(seen[-1][mask]))
        aux = F.cross_entropy(logits, act[:, :-1][mask])
        acc = (logits.argmax(-1) == act[:, :-1][mask]).float().mean().item()
        loss = loss + args.action_weight * aux
        if args.query_weight:
            qt = query_targets(act[:, :-1], labels[:, 1:], weights[:, 1:], carry[:, :-1], first)
            qlogits = qhead(rms(seen[-1][qt != -100]))
            qaux = F.cross_entropy(qlogits, qt[qt != -100])
            loss = loss + args.query_weight * qaux
            acc = (acc, round((qlogits.argmax(-1) == qt[qt != -100]).float().mean().item(), 2))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + head_params, 1.0)
        opt.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} action {aux.item():.3f} (acc, query acc {acc}) "
                  f"carry/attend {[tuple(round(x, 3) for x in e) for e in log]}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "step": args.steps}, args.save)


if __name__ == "__main__":
    main()
