"""The plugin API: everything a plugin's package may use from the core.

A plugin imports from here (``from mlx_lm_ext.api import PluginError,
hookimpl``), from ``mlx_lm_ext.safefs`` (the no-follow file operations for
plugins that keep files) and nothing else of the core; its tests may also
use ``mlx_lm_ext.testing``. ``PUBLIC_MODULES`` names them, and
``tests/test_plugin_api.py`` holds every plugin to it. The rest of
``mlx_lm_ext`` is the host's and may change under a plugin.

What each name is for (``docs/core.md``, "The plugin API", says
where the host uses it):

* ``PluginError``: raise it for bad user input (one line, exit status 2).
* ``hookimpl``: the decorator of a plugin's hook functions (pluggy's marker
  for the project ``mlx_lm_ext``; the hooks are in ``hookspecs.py``).
* ``request_info``, ``override_attention``, ``override_rope``,
  ``rope_modules``, ``flush_layers``: what the host offers while mlx-lm
  runs (``host.py``).
* ``backbone``: a model split as ``head(backbone(x))``, checked
  (``backbone.split``, ``backbone.resolve``, ``backbone.Arch``).
* ``counter``, ``gauge``: metric families for the ``metrics`` hook.
* ``cache_root``: the folder under which a plugin keeps its caches.
* ``prompt_cache_classes``: the cache classes active plugins append to
  prompt caches, for a plugin that stores prompt caches.

Importing this module is cheap (no mlx, no pluggy, no prometheus_client):
``hookimpl`` and ``backbone`` load pluggy and mlx on first use, and the
helpers below import their module when called.
"""

from pathlib import Path
from typing import Any, Dict, List, Tuple

from . import PluginError
from .host import flush_layers, override_attention, override_rope, request_info, rope_modules

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pluggy

    from . import backbone
    from .metrics import Metric

    hookimpl: pluggy.HookimplMarker

# Modules a plugin may import; ``mlx_lm_ext`` itself is the user's API
# (``enable``, ``disable``, ``enabled``) and re-exports ``PluginError`` and
# ``hookimpl``; ``mlx_lm_ext.testing`` is for plugins' tests only.
PUBLIC_MODULES = ("mlx_lm_ext", "mlx_lm_ext.api", "mlx_lm_ext.safefs", "mlx_lm_ext.testing")

__all__ = [
    "PluginError",
    "hookimpl",
    "request_info",
    "flush_layers",
    "override_attention",
    "override_rope",
    "rope_modules",
    "backbone",
    "counter",
    "gauge",
    "cache_root",
    "prompt_cache_classes",
]


def counter(name: str, doc: str, values: Dict[Tuple[str, ...], float], labels=()) -> "Metric":
    """A Prometheus counter family for a plugin's ``metrics`` hook: ``{label values: total}``."""
    from . import metrics

    return metrics.counter(name, doc, values, labels)


def gauge(name: str, doc: str, values: Dict[Tuple[str, ...], float], labels=()) -> "Metric":
    """A Prometheus gauge family for a plugin's ``metrics`` hook: ``{label values: value}``."""
    from . import metrics

    return metrics.gauge(name, doc, values, labels)


def cache_root() -> Path:
    """The project's cache folder (``$MLX_LM_EXT_CACHE``, else the user cache dir)."""
    from . import models

    return models.cache_root()


def prompt_cache_classes() -> List[type]:
    """Cache classes the active plugins append to prompt caches (their ``prompt_cache_classes``)."""
    from . import integration

    return integration.prompt_cache_classes()


def __getattr__(name: str) -> Any:
    # hookimpl needs pluggy and backbone needs mlx: load them on first use only.
    if name == "hookimpl":
        import pluggy

        value: Any = pluggy.HookimplMarker("mlx_lm_ext")
    elif name == "backbone":
        import importlib

        value = importlib.import_module("mlx_lm_ext.backbone")
    else:
        raise AttributeError(f"module 'mlx_lm_ext.api' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
