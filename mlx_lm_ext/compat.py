"""Which mlx-lm this host is built against (it patches mlx-lm's internals)."""

import importlib.metadata
from typing import Optional

from . import PluginError

SUPPORTED = "0.32."


def mlx_lm_version() -> str:
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def problem() -> Optional[str]:
    """A message if the installed mlx-lm is not one this host supports."""
    version = mlx_lm_version()
    if version.startswith(SUPPORTED):
        return None
    return (
        f"mlx-lm-ext supports mlx-lm {SUPPORTED}x, found {version}; "
        f"install a matching one: pip install 'mlx-lm>=0.32,<0.33'"
    )


def check() -> None:
    message = problem()
    if message:
        raise PluginError(message)
