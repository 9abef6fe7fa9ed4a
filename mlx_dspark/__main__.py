"""``python -m mlx_dspark``: the ``mlx-dspark`` command (cli/dispatch.py)."""

import sys

from .cli import main

sys.exit(main())
