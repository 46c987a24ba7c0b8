"""mlx-lm-ssd-cache: a disk tier under mlx_lm.server's prompt cache.

``mlx_lm.server --model M --plugin ssd-cache`` keeps mlx-lm's in-memory
prompt cache and writes every prompt cache it stores to disk behind the
generation thread; after an eviction or a restart a request's longest stored
prefix is restored from disk instead of being prefilled again.
"""

__version__ = "0.1.0"

__all__ = ["SSDPromptCache", "DiskTier"]


def __getattr__(name):
    # Keep `import mlx_lm_ssd_cache` light (the plugin host imports it to list
    # subcommands); mlx loads with the classes.
    if name == "SSDPromptCache":
        from .cache import SSDPromptCache

        return SSDPromptCache
    if name == "DiskTier":
        from .disk import DiskTier

        return DiskTier
    raise AttributeError(f"module 'mlx_lm_ssd_cache' has no attribute {name!r}")
