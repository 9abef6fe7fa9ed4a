"""Decoding: a sequence's state (``session``), the speculative loop (``loop``), sampling and
verification (``sampling``), the break-even controller (``controller``) and grammar
constraints (``grammar``)."""
