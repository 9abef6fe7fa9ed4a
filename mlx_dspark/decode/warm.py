"""Warming a pair up: every kernel a generation runs, run once before the first one."""

from __future__ import annotations

from ..kernels.norm import FUSED_ROWS
from ..request import AUTO_DRAFT, Request
from ..policy import length
from .batch import decode
from .session import Session

# The warm-up's prompt: longer than the blocks that take the short-block kernels (the fused
# norm's FUSED_ROWS, the target's serial SSM recurrence, nemotron_h.SERIAL_MAX = 8), so that
# its prefill runs the kernels a real prompt's does. With a 2-token prompt the first real
# prefill compiled them: a 49-token prefill measured 19-22 tokens/s on a fresh machine, about
# 940 warm (issue 41).
PROMPT = list(range(2 * FUSED_ROWS))


def warm_up(pair, num_draft: int | str = 3):
    """Run every kernel a generation runs once, on a throwaway session: a prefill of
    :data:`PROMPT`, serial steps, and rounds of ``num_draft`` drafts (at most the drafter's; "auto": every length, measuring
    the cost curve the length is chosen on, decode/length.py). MLX compiles a kernel on its
    first use (on the CPU backend, into a disk cache: about 50 s on a fresh 2-core machine,
    once); done here, that cost never lands in a generation's timings or in the
    break-even controller's estimates. Forced modes: the pair's learned controller is not
    touched."""
    # ids inside the table, and room for a token after the prompt in a small context
    limit = pair.target.context_limit or len(PROMPT) + 1
    prompt = [i % pair.target.config.vocab_size for i in PROMPT][:limit - 1]
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
