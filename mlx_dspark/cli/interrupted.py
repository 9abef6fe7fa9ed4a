"""How a Ctrl-C ends the ``mlx-dspark`` command, wherever it lands (the imports, the model load,
a prefill, an answer): one line and exit code 130. Standard library only, so the entry point
(cli/__init__.py) has it before anything else is imported."""

import signal
import sys

RETRY = 0.01        # seconds: a Ctrl-C that landed in a finalizer is raised again this much later


def arm():
    """Ctrl-C raises KeyboardInterrupt where the command is, as Python's own handler does, but
    never inside a finalizer (``__del__``, such as the ``regex`` package's, run by the garbage
    collector while a tokenizer loads): Python prints an exception there as "ignored", with its
    traceback, and goes on, so that Ctrl-C would be lost. There it is raised again a moment
    later (SIGALRM), once the finalizer has returned. A process started with Ctrl-C ignored
    (a background job) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGALRM, _interrupt)


def _interrupt(signum, frame):
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            signal.setitimer(signal.ITIMER_REAL, RETRY)
            return
        f = f.f_back
    raise KeyboardInterrupt


def interrupted(command: str | None) -> int:
    """Say so on stderr and return 130. A second Ctrl-C on the way out does nothing (it would
    be a traceback): a handler, not SIG_IGN, so processes started later are not left deaf."""
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0)        # nor one deferred from a finalizer
    print(f"\nmlx-dspark{'' if command is None else ' ' + command}: interrupted",
          file=sys.stderr)
    return 130
