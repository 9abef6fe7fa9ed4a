"""Checkpoints as files: their receipts and hashes (``integrity``), whether they fit in memory
(``memory``), and Hugging Face repo ids converted into the local cache (``hub``)."""
