"""Where flash-cce keeps files: ``auto``'s choices and the compiled row kernel."""

import os
from pathlib import Path

CACHE_ENV = "MLX_LM_FLASH_CCE_CACHE"  # a folder for choices and kernels, not the user cache dir


def cache_dir() -> Path:
    """``$MLX_LM_FLASH_CCE_CACHE``, else ``flash-cce/`` under the project's cache root."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from mlx_lm_ext.api import cache_root

    return cache_root() / "flash-cce"
