"""Step 3: train the Nemotron-H-shaped target (transformers NemotronHForCausalLM) on the corpus.

Fixed seed, AdamW, cosine schedule, fp32 on CPU. Checkpoints to training/work/target_ckpt.pt
every CKPT_EVERY steps and resumes from it; the data of step s depends only on (SEED, s), so an
interrupted run finishes identically. Writes the HF checkpoint to training/work/target_hf/.

``--tool-rows N`` (issue 41's next recipe): every step also takes N tool-use rows (one
multi-call conversation, hard calls among randomly named tools with composed descriptions, and
tool_data.example draws), the loss on their replies with the called name weighted, so the
choice of tool is learnt with the corpus rather than tuned in afterwards; ``--pattern`` gives
the target another layer layout (``M*M*EM``: two attention layers) and ``--name`` its own
checkpoint and output; ``--probe-every`` prints tool_probe.py's copy and choice probes.

    /work/venv-fx/bin/python training/train_target.py [--steps N]
    PYTHONPATH=<testkit's parent>:training ... training/train_target.py --steps 4000 --pattern 'M*M*EM' --tool-rows 4 --name tools2 --probe-every 250
"""
import argparse
import math
import time

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from common import THREADS, batch, resume, save_target, tokens
from data import WORK
from shapes import hf_config_kwargs

SEED = 1234
BATCH = 8
LR = 3e-3
WARMUP = 30
CKPT_EVERY = 50


def make_model(pattern=None):
    torch.manual_seed(SEED)
    shape = hf_config_kwargs()
    if pattern:
        shape.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    cfg = NemotronHConfig(**shape, architectures=["NemotronHForCausalLM"],
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return NemotronHForCausalLM(cfg)


def tool_loss(model, step, rows):
    """The answer loss on ``rows`` tool-use rows of step ``step`` (their ids depend on it alone)."""
    import tune_tools
    ids, labels, weights, _ = tune_tools.hard_answers(step, 4, rows, rows // 2, rows - rows // 2 - 1, 1, 10)
    return tune_tools.weighted_answer_loss(model, ids, labels, weights)


def probe(model, step, probes):
    import tool_probe
    print(f"probe step {step}: {tool_probe.report(model, probes)}", flush=True)


def lr_at(step, total):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total - WARMUP))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500, help="length of the LR schedule")
    ap.add_argument("--stop-at", type=int, default=None, help="end early at this checkpointed step")
    ap.add_argument("--pattern", help="hybrid_override_pattern instead of the shape's")
    ap.add_argument("--tool-rows", type=int, default=0, help="tool-use rows added to every step")
    ap.add_argument("--name", default="target", help="training/work/NAME_ckpt.pt and NAME_hf/")
    ap.add_argument("--probe-every", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    stream = tokens("train")
    ckpt, out_dir = WORK / f"{args.name}_ckpt.pt", WORK / f"{args.name}_hf"
    if args.tool_rows or args.probe_every:
        import tool_data
        import tool_probe
        tool_data.VOCAB_NAMES = tool_data.COMPOSED_DESCRIPTIONS = True
        probes = tool_probe.heldout_examples(), tool_probe.generated_examples(50)
    model = make_model(args.pattern)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params/1e6:.2f} M parameters, {len(stream)/1e6:.2f} M training tokens")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    step = resume(ckpt, model, opt)
    model.train()
    stop = args.stop_at or args.steps
    t0, seen = time.time(), 0
    while step < stop:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps)
        if args.probe_every and step % args.probe_every == 0:
            probe(model, step, probes)
        x = batch(stream, step, BATCH, SEED)
        out = model(x[:, :-1], labels=x[:, :-1].clone())  # HF shifts labels internally
        loss = out.loss + (tool_loss(model, step, args.tool_rows) if args.tool_rows else 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        if step % 10 == 0:
            dt = time.time() - t0
            print(f"step {step} loss {out.loss.item():.3f} (with tools {loss.item():.3f}) lr {lr_at(step, args.steps):.2e} "
                  f"{seen/dt:.0f} tok/s", flush=True)
        if step % CKPT_EVERY == 0 or step == stop:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    if args.probe_every:
        probe(model, step, probes)
    save_target(model, out_dir, {"steps": step, "schedule_steps": args.steps, "batch": BATCH,
                                 "pattern": args.pattern, "tool_rows": args.tool_rows})


if __name__ == "__main__":
    main()
