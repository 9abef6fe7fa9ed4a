"""Shared test setup. The helper modules beside the tests (loop_helpers, target_helpers,
reference_drafter, cli_pair) import by name because pytest puts this folder on ``sys.path``
(rootdir-relative, no ``__init__.py``); the committed tiny drafter fixture's module imports as
``fixtures.drafter.tiny`` the same way. Nothing outside tests/ imports from it."""

import pytest


@pytest.fixture
def template_calls(monkeypatch):
    """``watch(tokenizer)`` returns the list of the keyword arguments of every later
    ``apply_chat_template`` call on tokenizers of its class (what reached the template)."""
    def watch(tokenizer):
        calls, real = [], type(tokenizer).apply_chat_template

        def spy(self, *a, **kw):
            calls.append(kw)
            return real(self, *a, **kw)
        monkeypatch.setattr(type(tokenizer), "apply_chat_template", spy)
        return calls
    return watch
