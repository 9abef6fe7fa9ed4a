"""A cheap teacher-forced probe of tool calling (issue 41, step 3d): does the target copy the
right offered tool's name after ``<function=``, and the argument after ``<parameter=KEY>``?

On N generated call examples with random names (tool_data.probe_example: 2-4 tools of different
actions, held-out files, thinking off) and on the 5 held-out requests (testkit/
demo_acts.py, their tool sets, rendered by the chat template as the server does), it reports:

  name1:   the argmax at the first name token is the right tool's first token
  offered: that argmax is the first token of *some* offered tool (copies, maybe the wrong one)
  name:    every name token right (teacher-forced)
  arg1:    the argmax at the argument's first token is right
  arg:     every argument token right (teacher-forced)

    $FX training/tool_probe.py [CKPT ...] [--n 50] [--rounded]    # CKPT: a tune checkpoint (.pt) or an HF dir
"""
import argparse
from pathlib import Path

import torch

import chat_data
import nvfp4_qat
import tool_data
from testkit.demo_acts import HELDOUT_REQUESTS, HELDOUT_TOOLS


def spans(reply, name, arg):
    """Indices (within reply ids) of the name tokens and of the main argument's tokens."""
    tok = chat_data.tokenizer()
    head = tok.encode("<tool_call>\n<function=", add_special_tokens=False)
    name_ids = tok.encode(name, add_special_tokens=False)
    assert reply[:len(head)] == head and reply[len(head):len(head) + len(name_ids)] == name_ids, \
        (tok.decode(reply), name)
    n0 = len(head)
    # the argument: the first "\n" after the first "<parameter=KEY>" then its tokens
    text_ids = reply
    k = n0 + len(name_ids)
    while tok.decode(text_ids[n0:k]).count("<parameter=") == 0 or not tok.decode(text_ids[n0:k]).endswith(">\n"):
        k += 1
    arg_ids = tok.encode(arg, add_special_tokens=False)
    a_ids = text_ids[k:k + len(arg_ids)]
    return list(range(n0, n0 + len(name_ids))), list(range(k, k + len(arg_ids))), a_ids == arg_ids


def heldout_examples():
    tok = chat_data.tokenizer()
    out = []
    for k, ask, name, arg, _ in HELDOUT_REQUESTS:
        tools = HELDOUT_TOOLS[k]
        key = next(iter(next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]["properties"]))
        prompt = tool_data.render([{"role": "user", "content": ask}], tools, False)
        reply = tool_data.call_text(name, {key: arg})
        out.append((tok.encode(prompt, add_special_tokens=False), tok.encode(reply, add_special_tokens=False),
                    name, arg, [t["function"]["name"] for t in tools]))
    return out


def generated_examples(n):
    tok = chat_data.tokenizer()
    out = []
    for i in range(n):
        prompt, reply, name, arg, names = tool_data.probe_example(i)
        out.append((prompt, reply, name, arg, names))
    return out


@torch.no_grad()
def probe(model, examples):
    tok = chat_data.tokenizer()
    model.eval()
    stats = {"name1": 0, "offered": 0, "name": 0, "arg1": 0, "arg": 0}
    rows = []
    for prompt, reply, name, arg, names in examples:
        ids = torch.tensor([prompt + reply])
        pred = model(ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()   # pred[j]: reply[j]
        nspan, aspan, ok = spans(reply, name, arg)
        firsts = {tok.encode(x, add_special_tokens=False)[0] for x in names}
        stats["name1"] += pred[nspan[0]] == reply[nspan[0]]
        stats["offered"] += pred[nspan[0]] in firsts
        stats["name"] += all(pred[j] == reply[j] for j in nspan)
        stats["arg1"] += pred[aspan[0]] == reply[aspan[0]]
        stats["arg"] += all(pred[j] == reply[j] for j in aspan)
        rows.append((name, tok.decode([pred[nspan[0]]]), tok.decode([pred[j] for j in nspan])))
    return {k: f"{v}/{len(examples)}" for k, v in stats.items()}, rows


def report(model, probes) -> str:
    """The held-out and generated probes' line (``probes``: (heldout_examples(), generated_examples(n)));
    the model is left in training mode."""
    held, gen = (probe(model, p)[0] for p in probes)
    model.train()
    return f"held-out {held} generated {gen}"


def load(path):
    from export_target import load_dequantized
    from transformers import NemotronHForCausalLM
    path = Path(path)
    if path.is_dir():
        return NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = load_dequantized()
    model.load_state_dict(torch.load(path)["model"])
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--rounded", action="store_true", help="the weights as the export rounds them (nvfp4_qat.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    held, gen = heldout_examples(), generated_examples(args.n)
    for c in args.ckpts:
        model = load(c)
        if args.rounded:
            nvfp4_qat.enable(model)
        h, hrows = probe(model, held)
        g, grows = probe(model, gen)
        print(f"{c}: held-out {h}  generated {g}", flush=True)
        if args.rows:
            print("  held-out:", hrows)
            print("  generated:", grows[:10])


if __name__ == "__main__":
    main()
