"""The demo pair at a coding agent's prompt length (issue 30): it declares a 65,536-token
context (its target's attention has no positional encoding and its DSpark drafter's is a
128-token window over relative positions, so only the declared limit was raised), and at
40,000 tokens it answers, speculating, exactly what serial decoding answers. One 40k-token
prefill: 592 s on the shared 2-core CPU box, so slow."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import mlx_dspark as md

LONG = 40_000


def long_prompt(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real Python (this repository's own source, repeated)."""
    text = "".join(Path(inspect.getfile(m)).read_text() for m in (md.api, md.request))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def test_the_demo_pair_declares_a_context_for_agents():
    pair = md.load()
    assert pair.target.context_limit >= 65536


@pytest.mark.slow
@pytest.mark.long       # about 10 minutes here: `python -m pytest -m long`
def test_at_40k_tokens_the_demo_pair_speculates_exactly_as_it_decodes_serially():
    pair = md.load()
    ids = long_prompt(pair.tokenizer, LONG)
    session = pair.session()
    md.generate(pair, ids[:-1], max_tokens=1, session=session, speculative=False)
    assert len(session.tokens) == LONG - 1          # prefilled once
    prefilled = session.snapshot()
    serial = md.generate(pair, ids, max_tokens=24, session=session, speculative=False)
    session.restore(prefilled)
    spec = md.generate(pair, ids, max_tokens=24, session=session, speculative=True,
                       num_draft=3)
    assert spec.tokens == serial.tokens and len(serial.tokens) == 24
    assert spec.stats["reused_tokens"] == LONG - 1 and spec.stats["rounds"] > 0
