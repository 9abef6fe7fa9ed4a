"""``python -m mlx_dspark.cli``: the ``mlx-dspark`` command."""

import sys

from . import main

sys.exit(main())
