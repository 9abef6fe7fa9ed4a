"""The ``mlx-dspark`` command: the parser and entry point (``main``), one handler per
subcommand (``commands``, ``chat``, ``bench``), and what they share (``common``)."""

from .common import CommandError
from .main import build_parser, main

__all__ = ["CommandError", "build_parser", "main"]
