"""How a Ctrl-C ends the ``mlx-dspark`` command, wherever it lands (the imports, the model load,
a prefill, an answer): one line and exit code 130. Standard library only, so the entry point
(cli/__init__.py) has it before anything else is imported."""

import signal
import sys


def interrupted(command: str | None) -> int:
    """Say so on stderr and return 130. A second Ctrl-C on the way out does nothing (it would
    be a traceback): a handler, not SIG_IGN, so processes started later are not left deaf."""
    signal.signal(signal.SIGINT, lambda *_: None)
    print(f"\nmlx-dspark{'' if command is None else ' ' + command}: interrupted",
          file=sys.stderr)
    return 130
