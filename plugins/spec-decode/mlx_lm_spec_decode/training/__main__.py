"""``python -m mlx_lm_spec_decode.training``: the train-drafter command."""

import sys

from .cli import main

sys.exit(main())
