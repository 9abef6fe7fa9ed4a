"""Shared test setup. The helper modules beside the tests (loop_helpers, target_helpers,
server_helpers, reference_drafter, cli_pair) import by name because pytest puts this folder on
``sys.path`` (rootdir-relative, no ``__init__.py``); the committed tiny drafter fixture's module
imports as ``fixtures.drafter.tiny`` the same way. Nothing outside tests/ imports from it."""

import os
import signal

import pytest

# A runner started in the background by a shell without job control (a CI script's `cmd &`,
# nohup) inherits SIGINT ignored, and so would every process the tests start: the Ctrl-C tests
# send SIGINT and need it delivered. A caught signal is reset to its default across exec, so
# catching it here gives the children Python's own Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """mlx-dspark's cache (the hashes recorded at the first load of a directory without a
    receipt, converted repo ids) is the run's own, never the user's; child processes inherit
    it. Tests that need their own still set MLX_DSPARK_CACHE."""
    before = os.environ.get("MLX_DSPARK_CACHE")
    os.environ["MLX_DSPARK_CACHE"] = str(tmp_path_factory.mktemp("mlx-dspark-cache"))
    yield
    if before is None:
        os.environ.pop("MLX_DSPARK_CACHE", None)
    else:
        os.environ["MLX_DSPARK_CACHE"] = before


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
