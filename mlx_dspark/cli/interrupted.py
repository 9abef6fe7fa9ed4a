"""How a Ctrl-C ends the ``mlx-dspark`` command, wherever it lands (the imports, the model load,
a prefill, an answer): one line and exit code 130. Standard library only, so the entry point
(cli/__init__.py) has it before anything else is imported."""

import functools
import signal
import sys

RETRY = 0.01        # seconds: a Ctrl-C that Python had to drop is raised again this much later


def arm():
    """A Ctrl-C is never lost: Python drops an exception raised where nobody can catch it (a
    finalizer, a weakref callback, such as the ``regex`` package's ``__del__`` or importlib's
    module-lock callback while a tokenizer loads), prints it as "ignored" with a traceback and
    goes on. Such a KeyboardInterrupt is raised again a moment later (SIGALRM) instead, where
    the command can end on it. A process started with Ctrl-C ignored (a background job) keeps
    ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGALRM, signal.default_int_handler)
        if getattr(sys.unraisablehook, "func", None) is not _unraisable:   # once a process
            sys.unraisablehook = functools.partial(_unraisable, sys.unraisablehook)


def _unraisable(hook, unraisable):
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        signal.setitimer(signal.ITIMER_REAL, RETRY)
    else:
        hook(unraisable)


def interrupted(command: str | None) -> int:
    """Say so on stderr and return 130. A second Ctrl-C on the way out does nothing (it would
    be a traceback): a handler, not SIG_IGN, so processes started later are not left deaf."""
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0)        # nor one Python had dropped
    print(f"\nmlx-dspark{'' if command is None else ' ' + command}: interrupted",
          file=sys.stderr)
    return 130
