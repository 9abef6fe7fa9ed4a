"""Issue 41 experiment: can a target of this size learn to *choose* a tool when that is all it
is trained on? A fresh model (``--shape`` and ``--pattern``, random init, the demo tokenizer)
trained only on tool_data's hard calls (2-4 randomly named tools of different actions; the
loss on the reply, the called name weighted), probed with tool_probe every ``--probe-every``
steps (chance for generated name1 is about 20 of 50). If a model trained on nothing else
cannot choose, the choice needs more than this size; if it can, the tool data belongs in
pretraining (step 3), not only in a tune. ``--init``: start instead from a tuned target's
checkpoint (tune_tools.py's, the demo's shape): can the corpus-pretrained target learn the
choice when every row of every batch asks for it, for many more steps than a tune gives it?

    PYTHONPATH=<testkit's parent>:training TRAIN_THREADS=1 $FX training/choice_probe.py [--pattern M*M*EM] [--steps 600]
    ... training/choice_probe.py --init training/work/bal_b.pt --lr 3e-4 --steps 1500
    ... training/choice_probe.py --pattern M*M*EM --init CKPT --first-step 3000 --steps 2000   # continue
"""
import argparse
import time

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

import shapes
import tool_data
import tool_probe
import tune_tools


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=shapes.TARGET)
    ap.add_argument("--pattern", help="hybrid_override_pattern instead of the shape's")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--probe-every", type=int, default=100)
    ap.add_argument("--init", help="a tune_tools.py checkpoint to start from (not random init)")
    ap.add_argument("--save", help="where to save the model at the end ({'model': ...}, as --init reads)")
    ap.add_argument("--first-step", type=int, default=0,
                    help="the step to count from (a continuation of --init draws new batches)")
    ap.add_argument("--vocab-names", action="store_true", help="tool_data.VOCAB_NAMES")
    ap.add_argument("--composed", action="store_true", help="tool_data.COMPOSED_DESCRIPTIONS")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(4242)
    tool_data.hard_call_options(args.vocab_names, args.composed)
    cfg = shapes.hf_config_kwargs(args.shape)
    if args.pattern:
        cfg["hybrid_override_pattern"] = args.pattern
    model = NemotronHForCausalLM(NemotronHConfig(**cfg, num_hidden_layers=len(cfg["hybrid_override_pattern"]))).float()
    if args.init:
        model.load_state_dict(torch.load(args.init)["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    probes = tool_probe.heldout_examples(), tool_probe.generated_examples(50)
    t0 = time.time()
    last = args.first_step + args.steps
    for step in range(args.first_step, last + 1):
        if step % args.probe_every == 0:
            print(f"probe step {step} ({time.time() - t0:.0f} s): {tool_probe.report(model, probes)}", flush=True)
        if step == last:
            if args.save:
                torch.save({"model": model.state_dict(), "step": step}, args.save)
            break
        ids, labels, weights, _ = tune_tools.hard_answers(step, 4, 8, 8, 0, 0, 10)
        loss = tune_tools.weighted_answer_loss(model, ids, labels, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
