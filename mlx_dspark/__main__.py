"""``python -m mlx_dspark``: the ``mlx-dspark`` command (cli/main.py)."""

import sys

from .cli import main

sys.exit(main())
