"""flash-cce tests: model fixtures (``tiny_model``, ``smollm2_path``, ...) come
from ``mlx_lm_ext.testing``, loaded for every run by the root pyproject;
``cce_helpers`` (this folder) holds the shared helper functions."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
