"""From logits to a token: warping and drawing (``sampling``), the processors a request's
penalties and biases make (``processors``), how a drafter draws (``draw``) and what the output
follows (``constraint``: none, or a grammar's matcher)."""
