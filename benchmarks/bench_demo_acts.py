"""The demo pair's held-out acts (issue 41): tool calls through the server's tool path (right
tool and argument on "auto", a forced call that closes within 64 tokens, an answer after the
tool's result that stops within 128), thinking that closes within 64 tokens, and the share of
distinct 4-grams in 64 greedy tokens on the README's and docs' example prompts plus 20 held-out
chat prompts, and DSpark's tokens per round over them (testkit/demo_acts.py holds the prompts and
the checks); and Codex's and opencode's recorded requests with held-out user turns: the agent's
own tool called with what the user named, then an answer that ends (testkit/agent_turns.py).
Prints JSON.

    python benchmarks/bench_demo_acts.py [--pair DIR]   # DIR/target and DIR/drafter; default the demo
    python benchmarks/bench_demo_acts.py --sampled-thinking 3   # also thinking at temperature 1, seeds 0-2"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import json

import mlx_dspark as md
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit import agent_turns, demo_acts


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pair", metavar="DIR", help="a folder holding target/ and drafter/")
    p.add_argument("--sampled-thinking", type=int, default=0, metavar="N",
                   help="also the thinking checks sampled at temperature 1 with seeds 0..N-1")
    args = p.parse_args(argv)

    def load():
        return md.load(f"{args.pair}/target", f"{args.pair}/drafter") if args.pair else md.load()

    engine, client = demo_acts.served(load)
    try:
        tools = demo_acts.tool_checks(client, "mlx-dspark-demo")
        thinking = demo_acts.thinking_checks(client, "mlx-dspark-demo")
        sampled = [r for seed in range(args.sampled_thinking)
                   for r in demo_acts.thinking_checks(client, "mlx-dspark-demo", 1.0, seed)]
    finally:
        engine.stop()
    engine, client = demo_acts.served(load, cache_bytes=256 << 20)
    try:
        agents = agent_turns.agent_checks(client)
    finally:
        engine.stop()
    for row in tools + agents:
        print(json.dumps(row), flush=True)
    for row in thinking:
        print(json.dumps(row), flush=True)
    loops = demo_acts.loop_checks(load())
    print(json.dumps(loops["each"], indent=0))
    summary = {
        "right_tool_and_argument": f"{sum(r['right'] for r in tools)}/{len(tools)}",
        "forced_calls_closed_within_64": f"{sum(r['forced_closed'] for r in tools)}/{len(tools)}",
        "answers_stopped_within_128": f"{sum(r['answer_finish'] == 'stop' for r in tools)}/{len(tools)}",
        "thinking_closed_within_64": f"{sum(r['closed'] for r in thinking)}/{len(thinking)}",
        "agent_calls_right": f"{sum(r['right'] for r in agents)}/{len(agents)}",
        "agent_answers_ended": f"{sum(r['answered'] for r in agents)}/{len(agents)}",
        "distinct_4grams_worst": loops["worst"], "distinct_4grams_mean": loops["mean"],
        "tokens_per_round": loops["tokens_per_round"]}
    if sampled:
        summary["thinking_closed_within_64_at_temperature_1"] = \
            f"{sum(r['closed'] for r in sampled)}/{len(sampled)}"
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
