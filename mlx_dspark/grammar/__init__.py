"""Constrained decoding: the grammars (``grammars``: JSON schema, ``json_object``, Nemotron tool
calls, Lark; llguidance underneath), what one may cost (``limits``) and agents' tool-call
grammars (``tools``)."""
