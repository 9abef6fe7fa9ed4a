"""The ``mlx-dspark`` command: the parser and entry point (``main``), one handler per
subcommand (``commands``, ``chat``, ``bench``), and what they share (``common``).

Nothing but interrupted.py (the standard library's) is imported here before ``main`` runs, so
that a Ctrl-C at any moment of the start, the imports included, ends the command as one
anywhere else does: one line, exit code 130."""

from .interrupted import arm, interrupted

__all__ = ["CommandError", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """The ``mlx-dspark`` command (main.py), from its first import on."""
    arm()
    try:
        from .main import main as run
    except KeyboardInterrupt:
        return interrupted(None)
    finally:
        globals()["main"] = _main       # importing main.py bound this package's "main" to it
    return run(argv)


_main = main


def __getattr__(name):
    if name == "CommandError":
        from .common import CommandError
        return CommandError
    if name == "build_parser":
        from .main import build_parser
        globals()["main"] = _main
        return build_parser
    raise AttributeError(f"module 'mlx_dspark.cli' has no attribute {name!r}")
