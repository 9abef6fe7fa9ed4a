"""The engine: a sequence's state (``session``), the batch that decodes every generation
(``batch``; a lone request is a batch of one), the round's steps (``loop``), the prefill in
pieces (``prefill``, ``pieces``), thinking budgets (``budget``) and the warm-up (``warm``).
When to speculate is ``policy``'s, how a token is drawn ``logits``', what it must follow
``grammar``'s."""
