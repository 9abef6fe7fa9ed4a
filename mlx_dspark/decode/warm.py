"""Warming a pair up: every kernel a generation runs, run once before the first one."""

from __future__ import annotations

from ..request import AUTO_DRAFT, Request
from . import length
from .loop import decode
from .session import Session


def warm_up(pair, num_draft: int | str = 3):
    """Run every kernel a generation runs once, on a throwaway session: serial steps, and
    rounds of ``num_draft`` drafts (at most the drafter's; "auto": every length, measuring
    the cost curve the length is chosen on, decode/length.py). MLX compiles a kernel on its
    first use (on the CPU backend, into a disk cache: about 50 s on a fresh 2-core machine,
    once); done here, that cost never lands in a generation's timings or in the
    break-even controller's estimates. Forced modes: the pair's learned controller is not
    touched."""
    limit = pair.target.context_limit or 3
    prompt = [0, 1 % pair.target.config.vocab_size][:limit - 1]     # room for a token after it
    modes = ["off"] if pair.drafter is None else ["off", "on"]
    longest = 1
    if pair.drafter is not None:
        longest = length.longest(pair.drafter) if num_draft == AUTO_DRAFT \
            else min(num_draft, pair.drafter.max_draft)
        num_draft = num_draft if num_draft == AUTO_DRAFT else longest
    for mode in modes:
        session = Session(pair.target, pair.drafter if mode == "on" else None)
        for _ in decode(session, Request(prompt, max_tokens=longest + 3,
                                         num_draft=num_draft if mode == "on" else 1,
                                         speculative=mode)):
            pass
