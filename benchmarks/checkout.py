"""Run a benchmark's child process on another checkout's code (``git worktree add --detach
PATH <commit>``): the editable install's finder pointed at PATH, before mlx_dspark is
imported. Benchmarks that compare today's code with a commit's import this."""

import os
import sys


def use(path: str):
    """Import ``mlx_dspark`` (and its ``converter``, ``kernels``) from the checkout at
    ``path`` in this process."""
    finder = next(m for name, m in sys.modules.items()
                  if name.startswith("__editable__") and "mlx_dspark" in name)
    finder.MAPPING.update({k: os.path.join(path, os.path.basename(v))
                           for k, v in finder.MAPPING.items()})
