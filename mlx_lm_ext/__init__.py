"""mlx-lm-ext: pluggy plugins inside mlx-lm's own commands.

This module is imported by the start-up hook of every Python process in the
environment, so it imports nothing heavy: pluggy and the plugin manager load
on first use.
"""

__version__ = "0.1.0"

__all__ = ["PluginError", "hookimpl", "enable", "disable", "enabled"]


class PluginError(ValueError):
    """Bad user input for a plugin: reported as a clear message, exit status 2."""


def enable(name: str, **options: object) -> object:
    """Turn plugin ``name`` on for mlx-lm calls made from this process.

    ``options`` are the plugin's command-line flags as keywords
    (``--ssd-cache-dir`` is ``ssd_cache_dir``); flags left out get their
    command-line defaults. They are checked as the command line checks the
    flags (a choice among the choices, a switch True or False, a value of
    the flag's type; text goes through that type). Raises ``PluginError``
    for an unknown plugin or a bad option. A plugin that drafts
    (spec-decode) then drafts in ``mlx_lm.generate`` and
    ``mlx_lm.stream_generate`` calls that pass no ``draft_model``.
    """
    import logging

    from . import _boot, integration

    if _boot.disabled():  # the variable always wins
        logging.getLogger("mlx_lm_ext").warning(
            "mlx-lm-ext: MLX_LM_EXT_DISABLE is set; plugin '%s' not enabled", name
        )
        return None
    _boot.install()  # where no .pth ran (python -S, embedded interpreters)
    return integration.enable(name, **options)


def disable(name: str) -> None:
    """Turn plugin ``name`` off again and undo its patches."""
    from . import integration

    integration.disable(name)


def enabled() -> list[str]:
    """Names of the plugins active in this process."""
    from . import plugins

    return list(plugins.active())


def __getattr__(name):
    # hookimpl needs pluggy; load it only when a plugin asks for it.
    if name == "hookimpl":
        import pluggy

        return pluggy.HookimplMarker("mlx_lm_ext")
    raise AttributeError(f"module 'mlx_lm_ext' has no attribute {name!r}")
