"""Checkpoints as files: what format one is (``formats``), their receipts and hashes
(``integrity``; ``recorded`` for a directory without a receipt), whether they fit in memory
(``memory``), Hugging Face repo ids resolved into the local cache (``hub``), and the drafter a
known target gets by default (``pairing``)."""
