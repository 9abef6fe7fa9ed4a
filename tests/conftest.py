"""Shared test setup. The helper modules beside the tests (loop_helpers, target_helpers,
reference_drafter, cli_pair) import by name because pytest puts this folder on
``sys.path``; the committed tiny drafter fixture's module (fixtures/drafter/tiny.py) is added
here once for every test file. Nothing outside tests/ imports from it."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "drafter"))
