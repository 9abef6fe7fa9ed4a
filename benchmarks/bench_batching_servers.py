"""Whole servers side by side (issue 34, item 5): ``mlx-dspark serve`` and ``mlx_lm.server``
on the same dense weights, many streamed requests at once against the same requests one after
another. (benchmarks/bench_batching.py measures the loop alone, no server.)

The weights: the demo target dequantized to a float32 Hugging Face directory and converted by
mlx-lm's own ``mlx_lm.convert`` (no quantization; testing/mlx_lm_layouts.py), or with
``--checkpoint real-width`` a Lightning-width four-layer synthetic target made the same way, or
``--weights DIR`` in mlx-lm's layout. ``mlx-dspark serve`` runs with the demo DSpark drafter and
``--speculative`` off, on and auto (``--dspark-modes``), ``mlx_lm.server`` with its batching
(on by default; a draft model would switch it off, so it gets none). Each server in turn gets
waves of 1, 2, 4 and 8 streamed greedy /v1/completions sent at once ("together") and the same
number sent one after another ("in turn"), every request a distinct prompt (no prompt reuse),
``--tokens`` each; one warm-up round, then ``--repeats`` rounds, medians. Aggregate tokens/s is
every request's completion tokens over the wave's wall time; TTFT is from the wave's start
(together) or the request's own send (in turn) to its first text. Every request's text is
checked against the first mlx-dspark server's for the same prompt (greedy: equal unless a
server's batch changes a row's numbers). Results in docs/batching.md.

    python benchmarks/bench_batching_servers.py [--tokens 64] [--repeats 3]
        [--checkpoint demo|real-width] [--weights DIR] [--drafter DIR|none]
        [--dspark-modes off,on,auto] [--dspark-python PYTHON]
        [--dspark-args '...'] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit/, from the checkout
from testkit.server import launch

CODE = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
        "class Stack:\n    def __init__(self):", "def quicksort(xs):",
        "import json\n\n\ndef load_config(path):", "def merge_sorted(a, b):",
        "class Counter:\n    def __init__(self):", "def parse_args(argv):"]
STREAMS = (1, 2, 4, 8)
DSPARK_MODES = ("off", "on", "auto")


def blas() -> str:
    return "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else \
        "stock BLAS"


def ratio_spread(num: list[float], den: list[float]) -> tuple[float, list[float]]:
    """The median of the repeat-by-repeat ratios ``num[i] / den[i]``, and their range."""
    ratios = sorted(x / y for x, y in zip(num, den))
    return statistics.median(ratios), [ratios[0], ratios[-1]]


def dense_weights(out: Path) -> Path:
    """The demo target's weights, dequantized exactly to float32 (a Hugging Face directory)
    and converted by ``mlx_lm.convert`` without quantization: what both servers load."""
    from mlx_dspark.api import DEMO
    from testkit.mlx_lm_layouts import dense_hf, mlx_lm_convert
    return mlx_lm_convert(dense_hf(DEMO / "target", out / "hf-fp32"), out / "mlx-lm-fp32",
                          dtype="float32")


def real_width_weights(out: Path) -> Path:
    """A Lightning-width four-layer checkpoint (hidden 2688, blocks M*EM, 8 experts; random
    weights, testing/synthetic.py) in the demo's vocabulary, through our converter, then
    dequantized to float32 and converted by ``mlx_lm.convert`` as the demo target is; the
    demo's tokenizer files go with it (both servers need one)."""
    import shutil

    from mlx_dspark.api import DEMO
    from mlx_dspark.converter.convert import convert
    from testkit.mlx_lm_layouts import TOKENIZER_FILES, dense_hf, mlx_lm_convert
    from testkit.synthetic import synth_lightning
    synth_lightning(out / "src", pattern="M*EM", experts=8, vocab=4096)
    convert(str(out / "src"), out / "converted", progress=False)
    hf = dense_hf(out / "converted", out / "hf-fp32")
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / "target" / name, hf / name)
    shutil.rmtree(out / "src")
    return mlx_lm_convert(hf, out / "mlx-lm-fp32", dtype="float32")


def stream_completion(client, prompt: str, max_tokens: int, t0: float | None = None):
    """(time to first text, completion tokens, text) of one streamed greedy completion; the
    time from ``t0`` (default: now)."""
    t0 = time.perf_counter() if t0 is None else t0
    ttft, text, tokens = None, [], None
    for c in client.completions.create(model="default_model", prompt=prompt,
                                       max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
        if c.usage is not None:
            tokens = c.usage.completion_tokens
        for ch in c.choices:
            if ch.text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(ch.text)
    return ttft, tokens, "".join(text)


def wave(client, prompts: list[str], max_tokens: int, at_once: bool) -> dict:
    """``prompts`` sent at once or one after another: aggregate tokens/s, each request's
    TTFT and text."""
    t0 = time.perf_counter()
    if at_once:
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = list(pool.map(lambda p: stream_completion(client, p, max_tokens, t0), prompts))
    else:
        out = [stream_completion(client, p, max_tokens) for p in prompts]
    wall = time.perf_counter() - t0
    return dict(tok_s=sum(o[1] for o in out) / wall, ttft=[o[0] for o in out],
                tokens=[o[1] for o in out], texts=dict(zip(prompts, (o[2] for o in out))))


def prompt_sets(rounds: int) -> list[dict]:
    """Per round, per stream count, the prompts of the together wave and of the in-turn
    wave: every one distinct (its first line numbers it), so no server reuses a prompt."""
    k = iter(range(10 ** 6))
    return [{n: {mode: [f"# example {next(k)}\n{CODE[i % len(CODE)]}" for i in range(n)]
                 for mode in ("together", "in_turn")} for n in STREAMS} for _ in range(rounds)]


def measure_server(url: str, sets: list[dict], max_tokens: int) -> dict:
    """Stream count -> the waves of every round after the first (the warm-up), interleaved
    together / in turn; and every request's text, by prompt."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    waves, texts = {n: [] for n in STREAMS}, {}
    for r, rounds in enumerate(sets):
        for n in STREAMS:
            w = {mode: wave(client, rounds[n][mode], max_tokens, mode == "together")
                 for mode in ("together", "in_turn")}
            for m in w.values():
                texts.update(m["texts"])
            if r:
                waves[n].append(w)
    return dict(waves=waves, texts=texts)


def summarize(name: str, waves: dict, reference_tok_s: dict | None = None) -> list[dict]:
    """One row per stream count: median aggregate tokens/s together and in turn, the ratio
    (median of per-round ratios, with its range), median and worst TTFT together, median
    TTFT in turn, and the together tokens/s over ``reference_tok_s[n]`` (mlx-lm's)."""
    rows = []
    for n, rounds in waves.items():
        tog = [w["together"]["tok_s"] for w in rounds]
        turn = [w["in_turn"]["tok_s"] for w in rounds]
        ratio, spread = ratio_spread(tog, turn)
        row = dict(server=name, streams=n, together_tok_s=statistics.median(tog),
                   in_turn_tok_s=statistics.median(turn), together_over_in_turn=ratio,
                   spread=spread,
                   ttft_together_median=statistics.median(
                       statistics.median(w["together"]["ttft"]) for w in rounds),
                   ttft_together_max=statistics.median(max(w["together"]["ttft"])
                                                       for w in rounds),
                   ttft_in_turn_median=statistics.median(
                       statistics.median(w["in_turn"]["ttft"]) for w in rounds),
                   tokens=sorted({t for w in rounds for m in w.values() for t in m["tokens"]}))
        if reference_tok_s:
            row["together_over_reference"] = row["together_tok_s"] / reference_tok_s[n]
        rows.append(row)
    return rows


def table(rows: list[dict], reference: str) -> str:
    """The rows as a Markdown table."""
    head = ("| server | streams | together tok/s | in turn tok/s | together / in turn [range] "
            "| TTFT together, median / max (s) | TTFT in turn, median (s) "
            f"| together / {reference} together |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        ref = r.get("together_over_reference")
        lines.append(
            f"| {r['server']} | {r['streams']} | {r['together_tok_s']:.1f} | "
            f"{r['in_turn_tok_s']:.1f} | {r['together_over_in_turn']:.2f}× "
            f"[{r['spread'][0]:.2f}-{r['spread'][1]:.2f}] | {r['ttft_together_median']:.3f} / "
            f"{r['ttft_together_max']:.3f} | {r['ttft_in_turn_median']:.3f} | "
            f"{'-' if ref is None else f'{ref:.2f}×'} |")
    return "\n".join(lines)


def servers(args, weights: Path) -> dict:
    """name -> (interpreter, module and flags) of each server, mlx-lm's first (the reference)."""
    from mlx_dspark.api import DEMO
    dspark = ["--model", str(weights), "--drafter", args.drafter or str(DEMO / "drafter"),
              "--dtype", "float32", *shlex.split(args.dspark_args)]
    out = {"mlx_lm.server": (sys.executable, ("mlx_lm", "server"), ["--model", str(weights)])}
    for mode in args.dspark_modes.split(","):
        name = shlex.join(["mlx-dspark", *shlex.split(args.dspark_args), "--speculative", mode])
        out[name] = (args.dspark_python, ("mlx_dspark.cli", "serve"),
                     dspark + ["--speculative", mode])
    return out


def servers_main(args):
    with tempfile.TemporaryDirectory() as tmp:
        made = real_width_weights if args.checkpoint == "real-width" else dense_weights
        weights = Path(args.weights) if args.weights else made(Path(tmp))
        commands = servers(args, weights)
        sets = prompt_sets(args.repeats + 1)
        measured, loads = {}, {}
        for name, (python, module, flags) in commands.items():
            log_path = Path(tmp) / f"{len(measured)}.log"
            with open(log_path, "wb") as log:
                try:                 # outside this checkout: `python -m` imports from the cwd
                    proc, url = launch(flags, 300, module, python, stdout=log, stderr=log,
                                       cwd=tmp)
                except RuntimeError:
                    sys.stderr.write(log_path.read_text(errors="replace")[-2000:])
                    raise
                try:
                    measured[name] = measure_server(url, sets, args.tokens)
                finally:
                    proc.terminate()
                    proc.wait(30)
            loads[name] = os.getloadavg()[0]
    names = list(commands)
    reference = names[0]
    ref_tok_s = {r["streams"]: r["together_tok_s"]
                 for r in summarize(reference, measured[reference]["waves"])}
    rows = [row for name in names
            for row in summarize(name, measured[name]["waves"], ref_tok_s)]
    base = measured[names[1]]["texts"]                   # ours, speculation off
    where = {p: f"{mode} x{n}" for rounds in sets for n, w in rounds.items()
             for mode, ps in w.items() for p in ps}
    differ = {name: sorted({where[p] for p, t in base.items() if m["texts"][p] != t})
              for name, m in measured.items()}
    same = {name: sum(m["texts"][p] == t for p, t in base.items())
            for name, m in measured.items()}
    if args.json:
        print(json.dumps(dict(rows=rows, same_text=same, differ_in=differ, requests=len(base),
                              loads=loads)))
        return
    what = args.weights or f"the {args.checkpoint} target, dequantized to float32, mlx_lm.convert"
    print(f"{what}, "
          f"{args.tokens} tokens per request, greedy /v1/completions, medians of "
          f"{args.repeats} rounds after a warm-up, {blas()}, {os.cpu_count()} cores, load "
          f"average after each server: "
          + ", ".join(f"{n} {v:.1f}" for n, v in loads.items()))
    for name, (python, module, flags) in commands.items():
        print(f"  {name}: {shlex.join([python, '-m', *module, *flags])}")
    print()
    print(table(rows, reference))
    print()
    print(f"texts equal to {names[1]}'s for the same prompt: "
          + ", ".join(f"{n} {k}/{len(base)}" for n, k in same.items()))
    for name, waves in differ.items():
        if waves:
            agree = [len(os.path.commonprefix([measured[name]["texts"][p], t]))
                     for p, t in base.items() if measured[name]["texts"][p] != t]
            print(f"  {name} differs in waves: {', '.join(waves)} ({len(agree)} requests; "
                  f"the texts agree for their first {min(agree)}-{max(agree)} characters, "
                  f"median {statistics.median(agree)}, of about {args.tokens} tokens)")
    short = ", ".join(f"{r['server']} x{r['streams']} {r['tokens']}" for r in rows
                      if r["tokens"] != [args.tokens])
    print(f"completion tokens per request: {short or f'all {args.tokens}'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds measured (default 3)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--checkpoint", choices=("demo", "real-width"), default="demo",
                    help="without --weights: the demo target (default) or a Lightning-width "
                         "4-layer synthetic one (random weights, no drafter made for it: give "
                         "--drafter none --dspark-modes off)")
    ap.add_argument("--weights", metavar="DIR",
                    help="a checkpoint in mlx-lm's layout both servers load instead")
    ap.add_argument("--drafter", metavar="DIR", help="mlx-dspark's drafter (default: the demo "
                                                     "DSpark drafter)")
    ap.add_argument("--dspark-modes", default=",".join(DSPARK_MODES),
                    help="the --speculative modes mlx-dspark runs in (default off,on,auto; the "
                         "first is the texts' reference)")
    ap.add_argument("--dspark-python", default=sys.executable, metavar="PYTHON",
                    help="the interpreter that runs mlx-dspark serve (another checkout's venv; "
                         "default this one)")
    ap.add_argument("--dspark-args", default="", help="more flags for mlx-dspark serve, such as "
                                                      "'--max-batch 8'")
    servers_main(ap.parse_args(argv))


if __name__ == "__main__":
    main()
