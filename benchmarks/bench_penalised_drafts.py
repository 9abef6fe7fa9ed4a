"""Issue 33's measurement: why the drafter's rows get the penalties too. Greedy decoding with
penalties on the demo pair, every drafter kind, the first code prompts of training/prompts.json:
drafts accepted per round when the drafter draws under the same penalties as the target (what
the loop does) against drafts drawn without them (the loop's draft step swapped for one that
drops the processors). The text is serial greedy's either way; only the acceptance moves.

    python benchmarks/bench_penalised_drafts.py [--prompts 5] [--max-tokens 64]
"""

import argparse
import json
from pathlib import Path

import mlx_dspark as md
from mlx_dspark.decode import loop
from mlx_dspark.logits.draw import Draw

PROMPTS = Path(__file__).resolve().parents[1] / "training" / "prompts.json"
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)


def unpenalised(run, bonus, n, noise):
    """The draft step with the drafter's rows left unprocessed."""
    draw = Draw(run.sampler, noise, run.constraint.drafting)
    return run.session.drafter.propose(bonus, n, draw, cache=run.session.draft_cache)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = json.loads(PROMPTS.read_text())["code"][:args.prompts]
    real = loop.draft
    for kind in ("dspark", "mtp", "eagle3"):
        pair, row = md.load(drafter=kind), {"drafter": kind}
        for label, step in (("penalised", real), ("unpenalised", unpenalised)):
            loop.draft, accepted, rounds, texts = step, 0, 0, []
            for prompt in prompts:
                r = md.generate(pair, prompt, max_tokens=args.max_tokens, speculative="on",
                                num_draft=3, **PENALTIES)
                accepted, rounds = accepted + r.stats["accepted"], rounds + r.stats["rounds"]
                texts.append(r.text)
            row[label] = round(accepted / rounds, 3)
            row.setdefault("texts", texts)
            row["same text"] = row["texts"] == texts
        loop.draft = real
        del row["texts"]
        print(json.dumps(row))


if __name__ == "__main__":
    main()
