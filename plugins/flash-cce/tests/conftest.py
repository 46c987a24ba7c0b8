"""flash-cce tests: model fixtures (``tiny_model``, ``smollm2_path``, ...) come
from ``mlx_lm_ext.testing``, loaded for every run by the root pyproject;
``cce_helpers`` (this folder) holds the shared helper functions."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest


@pytest.fixture(autouse=True)
def _autotune_cache(tmp_path, monkeypatch):
    """Each test's auto-backend choices go to its own folder, never the user's cache;
    a memory limit a loss held in one test (on a GPU) does not leak into the next."""
    from mlx_lm_flash_cce import autotune, budget

    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "flash-cce-cache"))
    autotune._MEMORY.clear()
    autotune._DP.clear()
    yield
    autotune._MEMORY.clear()
    autotune._DP.clear()
    budget.LIMIT.release()
