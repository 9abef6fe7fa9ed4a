"""The three modes measured on token-id prompts with any drafter (benchmarks/bench_loop.py):
``mlx-dspark bench``'s measurement (bench.measure, bench.summarize) without a tokenizer, for
drafters made per prompt (the oracle drafters need the serial output in advance)."""

from __future__ import annotations

from mlx_dspark.cli.measure import MODES, measure, run_once, summarize
from mlx_dspark.decode.session import ControllerHome
from mlx_dspark.request import Request


def compare(target, make_drafter, prompts, max_tokens=64, num_draft=3, options=None,
            repeats=3, warmup=1, fresh_auto=False) -> dict:
    """Measure the three modes on ``prompts`` (lists of token ids); ``options``: Request
    sampling fields (temperature, top_p, top_k, sampling; default greedy).

    ``make_drafter(prompt, reference)`` returns the drafter for one prompt; ``reference`` is the
    prompt followed by the serial output (what a test oracle needs; real drafters ignore it).

    "auto" keeps what its controller learned from one call to the next, per drafter, as a
    loaded pair does (``mlx-dspark bench``, the API, chat, the server); ``fresh_auto`` starts
    every call from nothing instead, warm-up round included: a one-shot process's first call."""
    options = options or {}

    def request(prompt, mode, seed):
        return Request(prompt, max_tokens=max_tokens, num_draft=num_draft,
                       speculative=MODES[mode], seed=seed, **options)

    refs = [run_once(target, None, request(p, "serial", 0))[0] for p in prompts]
    drafters = [make_drafter(p, p + r) for p, r in zip(prompts, refs)]
    homes = {id(d): ControllerHome() for d in drafters}

    def run(i, mode, seed):
        home = homes[id(drafters[i])] if mode == "auto" and not fresh_auto else None
        return run_once(target, drafters[i], request(prompts[i], mode, seed), home)

    measure(run, len(prompts), warmup)
    return summarize(measure(run, len(prompts), repeats, first_seed=warmup)[0], num_draft)
