"""Shared test setup. The helper modules beside the tests (loop_helpers, target_helpers,
reference_drafter, cli_pair) import by name because pytest puts this folder on ``sys.path``
(rootdir-relative, no ``__init__.py``); the committed tiny drafter fixture's module imports as
``fixtures.drafter.tiny`` the same way. Nothing outside tests/ imports from it."""
