"""How a Ctrl-C ends the ``mlx-dspark`` command, wherever it lands (the imports, the model load,
a prefill, an answer, the way out): one line and exit code 130. Standard library only, so the
entry point (cli/__init__.py) has it before anything else is imported."""

import functools
import signal
import sys

RETRY = 0.01        # seconds: a Ctrl-C put off (see arm) is raised again this much later

# True once a Ctrl-C has been raised as KeyboardInterrupt and nothing has carried on from it
# (carry_on): the command is on its way out, and a second Ctrl-C must not raise into the
# handler that is saying so.
_spent = False


def arm():
    """A Ctrl-C is never lost and never breaks an import: it raises KeyboardInterrupt where the
    command is, as Python's own handler does, except inside an import or a finalizer
    (``__del__``), where it is put off and raised again a moment later (SIGALRM). Inside an
    import an extension's initialisation may turn it into an ImportError with a traceback
    (numpy's, seen: "PyCapsule_Import could not import module datetime"); inside a finalizer or
    a weakref callback (importlib's module-lock one) Python prints it as "ignored" and goes
    on. A KeyboardInterrupt dropped that way anywhere else is put off the same way. One Ctrl-C
    raises once: until someone carries on from it, a second one does nothing (it would land in
    the ``except`` that is ending the command, and print a traceback). A process started with
    Ctrl-C ignored (a background job) keeps ignoring it."""
    global _spent
    _spent = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGALRM, _interrupt)
        if getattr(sys.unraisablehook, "func", None) is not _unraisable:   # once a process
            sys.unraisablehook = functools.partial(_unraisable, sys.unraisablehook)


def _interrupt(signum, frame):
    global _spent
    if signum == signal.SIGINT and _spent:
        return
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__" or f.f_code.co_filename.startswith("<frozen importlib"):
            signal.setitimer(signal.ITIMER_REAL, RETRY)
            return
        f = f.f_back
    _spent = True
    raise KeyboardInterrupt


def _unraisable(hook, unraisable):
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        signal.setitimer(signal.ITIMER_REAL, RETRY)     # SIGALRM raises it even when spent
    else:
        hook(unraisable)


def carry_on():
    """The command caught a Ctrl-C's KeyboardInterrupt and goes on (chat, at its prompt or
    after a stopped message): the next Ctrl-C raises again."""
    global _spent
    _spent = False


def finished():
    """The command is done and only the interpreter's exit is left: a Ctrl-C now does nothing
    (it would be a traceback from the console script or the interpreter's shutdown)."""
    global _spent
    _spent = True


def interrupted(command: str | None) -> int:
    """Say so on stderr and return 130. A second Ctrl-C on the way out does nothing (see arm),
    nor does one put off before."""
    finished()
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(f"\nmlx-dspark{'' if command is None else ' ' + command}: interrupted",
          file=sys.stderr)
    return 130
