"""How a Ctrl-C ends the ``mlx-dspark`` command, wherever it lands (the imports, the model load,
a prefill, an answer): one line and exit code 130. Standard library only, so the entry point
(cli/__init__.py) has it before anything else is imported."""

import functools
import signal
import sys

RETRY = 0.01        # seconds: a Ctrl-C put off (see arm) is raised again this much later


def arm():
    """A Ctrl-C is never lost and never breaks an import: it raises KeyboardInterrupt where the
    command is, as Python's own handler does, except inside an import or a finalizer
    (``__del__``), where it is put off and raised again a moment later (SIGALRM). Inside an
    import an extension's initialisation may turn it into an ImportError with a traceback
    (numpy's, seen: "PyCapsule_Import could not import module datetime"); inside a finalizer or
    a weakref callback (importlib's module-lock one) Python prints it as "ignored" and goes
    on. A KeyboardInterrupt dropped that way anywhere else is put off the same way. A process
    started with Ctrl-C ignored (a background job) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGALRM, _interrupt)
        if getattr(sys.unraisablehook, "func", None) is not _unraisable:   # once a process
            sys.unraisablehook = functools.partial(_unraisable, sys.unraisablehook)


def _interrupt(signum, frame):
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__" or f.f_code.co_filename.startswith("<frozen importlib"):
            signal.setitimer(signal.ITIMER_REAL, RETRY)
            return
        f = f.f_back
    raise KeyboardInterrupt


def _unraisable(hook, unraisable):
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        signal.setitimer(signal.ITIMER_REAL, RETRY)
    else:
        hook(unraisable)


def interrupted(command: str | None) -> int:
    """Say so on stderr and return 130. A second Ctrl-C on the way out does nothing (it would
    be a traceback): a handler, not SIG_IGN, so processes started later are not left deaf."""
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0)        # nor one put off
    print(f"\nmlx-dspark{'' if command is None else ' ' + command}: interrupted",
          file=sys.stderr)
    return 130
