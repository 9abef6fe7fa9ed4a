"""The ``mlx-dspark`` command: the parser and its dispatch (``dispatch``), one handler per
subcommand (``commands``, ``chat``, ``bench``), and what they share (``common``).

Nothing but interrupted.py (the standard library's) is imported here before ``main`` runs, so
that a Ctrl-C at any moment of the start, the imports included, ends the command as one
anywhere else does: one line, exit code 130."""

from .interrupted import arm, finished, interrupted

__all__ = ["CommandError", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """The ``mlx-dspark`` command (dispatch.py), from its first import on.

    Run as the process's command (``argv`` None: the console script, ``python -m mlx_dspark``)
    it owns Ctrl-C from its first instruction to the interpreter's exit: everything it does,
    the way out included, is inside the one ``try`` whose ``except`` says "interrupted", and
    once the command is done a Ctrl-C does nothing. Called with ``argv`` (a test, a script) it
    leaves the caller's signal handlers as they are."""
    try:            # first: the call into arm() is the first point a signal can be handled
        try:
            if argv is None:
                arm()
            from .dispatch import main as run
            return run(argv)
        finally:        # returning, or raising (SystemExit from --help, a bug's traceback)
            if argv is None:
                finished()
    except KeyboardInterrupt:
        return interrupted(None)


def __getattr__(name):
    if name == "CommandError":
        from .common import CommandError
        return CommandError
    if name == "build_parser":
        from .dispatch import build_parser
        return build_parser
    raise AttributeError(f"module 'mlx_dspark.cli' has no attribute {name!r}")
