"""``python -m mlx_lm_ext <command> ...``: as the console script, for
interpreters that skip ``.pth`` files (``python -S``, some embedders)."""

import sys

from .cli import main

sys.exit(main())
