"""The plugin manager: find installed plugins, register the named ones.

Plugins are found through the entry-point group ``mlx_lm_ext.plugins`` but
imported only when named, so an installed plugin that nobody names costs
nothing and changes nothing. Pluggy holds the registrations; the hooks are
called here (``first``, ``collect``, ``each``, ``call``), never through
pluggy's ``pm.hook`` relay: ``hookspecs.py`` says why.
"""

import argparse
import functools
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, NoReturn, Optional, Tuple, Union

import pluggy

from . import PluginError, hookspecs

GROUP = "mlx_lm_ext.plugins"
COMMANDS = ("generate", "server", "lora")
# The suite's own plugins, to name the package of one that is not installed.
SUITE_PACKAGES = {
    "spec-decode": "mlx-lm-spec-decode",
    "ssd-cache": "mlx-lm-ssd-cache",
    "flash-cce": "mlx-lm-flash-cce",
}
SUITE_LOSSES = {"flash-cce": "flash-cce", "orpo": "flash-cce", "dpo": "flash-cce"}

log = logging.getLogger("mlx_lm_ext")


class ActivationFailed(PluginError):
    """A plugin broke while activating (not the user's input): exit status 1."""


@dataclass
class Active:
    """One active plugin: its module, the command it serves, its options."""

    plugin: Any
    command: str
    args: argparse.Namespace
    options: Any  # what its ``activate`` returned (validated options), or None


@dataclass
class State:
    """Everything the host knows about activation, in one place."""

    manager: Optional[pluggy.PluginManager] = None
    active: Dict[str, Active] = field(default_factory=dict)  # in activation order
    # Parsed command line per command ("generate", "server", "lora"), and the
    # plugins' options merged for "python" (``mlx_lm_ext.enable``).
    args: Dict[str, argparse.Namespace] = field(default_factory=dict)


STATE = State()


def manager() -> pluggy.PluginManager:
    if STATE.manager is None:
        STATE.manager = pluggy.PluginManager("mlx_lm_ext")
        STATE.manager.add_hookspecs(hookspecs)
    return STATE.manager


def installed() -> Dict[str, importlib.metadata.EntryPoint]:
    """``{name: EntryPoint}`` of every installed plugin."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def distribution(name: str) -> Tuple[str, str]:
    """``(distribution name, version)`` that provides plugin ``name``."""
    ep = installed().get(name)
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("?", "?")
    return (dist.metadata["Name"], dist.version)


def split_names(values: Union[None, str, Iterable[Any]]) -> List[str]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]``: --plugin repeats and takes commas."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    names = []
    for v in values:
        for name in str(v).split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names


def unknown_loss_message(loss: str) -> str:
    """Why ``--loss loss`` is unknown: the installed losses, and the plugin to install."""
    lora = [n for n in sorted(installed()) if "lora" in extends(n)]
    losses = [x for n in lora for x in loss_names(n)]
    text = f"unknown loss '{loss}' (losses: {', '.join(['default', *losses])})"
    owner = SUITE_LOSSES.get(loss)
    if owner is not None and owner not in installed():
        text += (
            f"; --loss {loss} comes with plugin {owner}, which is not installed: "
            f"install the package {SUITE_PACKAGES[owner]} (from a clone: pip install -e plugins/{owner})"
        )
    return text


def flag_owner(flag: str, command: str, named: Iterable[str] = ()) -> Optional[Tuple[str, str]]:
    """``(plugin, its command)``: the installed plugin, not among ``named``, with
    ``flag`` for ``command`` (else for a command it does extend); read from its
    module without registering it."""
    for name in sorted(set(installed()) - set(named)):
        cmds = extends(name)
        for cmd in sorted(cmds, key=lambda c: c != command):  # ``command`` first
            parser = argparse.ArgumentParser(add_help=False)
            try:
                module = installed()[name].load()
                add = getattr(module, "add_arguments", None)
                if callable(add):
                    add(command=cmd, group=parser.add_argument_group(name))
            except Exception:  # a broken plugin is no owner (mlx-lm-ext plugins says why)
                break
            if any(flag in a.option_strings for a in parser._actions):
                return name, cmd
    return None


def unrecognized(
    parser: argparse.ArgumentParser, extra: List[str], command: str, named: Iterable[str]
) -> NoReturn:
    """Exit 2 for arguments ``parser`` does not know, naming the plugin a flag belongs to."""
    for arg in extra:
        flag = arg.split("=", 1)[0]
        found = flag_owner(flag, command, named) if flag.startswith("--") else None
        if found is None:
            continue
        owner, cmd = found
        dist, _ = distribution(owner)
        where = f"{flag} belongs to plugin {owner} (package {dist})"
        if cmd != command:
            fail(f"{where}, which extends mlx_lm.{cmd}, not mlx_lm.{command}")
        if command == "lora" and callable(getattr(installed()[owner].load(), "make_loss", None)):
            fail(f"{where}: add --loss {owner} (or --plugin {owner})")
        fail(f"{where}: add --plugin {owner}")
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


def unknown_message(name: str) -> str:
    names = sorted(installed())
    have = ", ".join(names) if names else "none"
    return f"unknown plugin '{name}' (installed plugins: {have})"


def load(name: str) -> Any:
    """Import plugin ``name`` and register it; returns the plugin object."""
    pm = manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        return plugin
    ep = installed().get(name)
    if ep is None:
        raise PluginError(unknown_message(name))
    try:
        plugin = ep.load()
    except Exception as e:
        raise PluginError(f"plugin '{name}' failed to import: {e!r}") from e
    pm.register(plugin, name=name)
    return plugin


def call(plugin: Any, hookname: str, **kwargs: Any) -> Any:
    """Call one plugin's implementation of ``hookname`` (None if it has none)."""
    caller = getattr(manager().hook, hookname)
    for impl in caller.get_hookimpls():
        if impl.plugin is plugin:
            return impl.function(**kwargs)
    return None


def implements(hookname: str, names: Optional[Iterable[str]] = None) -> bool:
    """Whether any (or any of ``names``) registered plugin implements a hook."""
    pm = manager()
    caller = getattr(pm.hook, hookname)
    plugins = None if names is None else {pm.get_plugin(n) for n in names}
    return any(plugins is None or impl.plugin in plugins for impl in caller.get_hookimpls())


def commands_of(name: str) -> List[str]:
    return list(call(load(name), "commands") or [])


def extends(name: str) -> List[str]:
    """The commands an installed plugin extends, without registering it."""
    ep = installed().get(name)
    if ep is None:
        return []
    try:
        commands = getattr(ep.load(), "commands", None)
        return list(commands() or []) if callable(commands) else []
    except Exception:
        return []


def loss_names(name: str) -> List[str]:
    """The ``--loss`` names plugin ``name`` provides: its own and its ``loss_names``."""
    ep = installed().get(name)
    try:
        more = getattr(ep.load(), "loss_names", None) if ep is not None else None
        return [name, *(more() or [])] if callable(more) else [name]
    except Exception:
        return [name]


def loss_provider(loss: Optional[str]) -> Optional[str]:
    """The installed plugin extending lora that provides ``--loss loss`` (or None)."""
    if not loss:
        return None
    lora = [n for n in sorted(installed()) if "lora" in extends(n)]
    if loss in lora:
        return loss
    return next((n for n in lora if loss in loss_names(n)), None)


def check_command(name: str, command: str) -> None:
    """Refuse a plugin named on a command it does not extend."""
    cmds = commands_of(name)
    if command in COMMANDS and command not in cmds:
        extends = ", ".join(f"mlx_lm.{c}" for c in cmds) or "nothing"
        raise PluginError(
            f"plugin '{name}' does not extend mlx_lm.{command} (it extends: {extends})"
        )


def add_arguments(
    name: str, command: str, parser: argparse.ArgumentParser
) -> argparse._ArgumentGroup:
    """Add plugin ``name``'s flags to ``parser`` in a group of their own."""
    group = parser.add_argument_group(f"plugin {name}")
    call(load(name), "add_arguments", command=command, group=group)
    return group


def flags(name: str, command: str) -> Dict[str, str]:
    """``{dest: "--flag"}`` of plugin ``name``'s flags for ``command`` (its long names).

    The first long name, as argparse derives ``dest``: for a negatable switch
    (``--x`` / ``--no-x``) the positive one, so ``--x on`` reads as it is.
    """
    parser = argparse.ArgumentParser(add_help=False)
    group = add_arguments(name, command, parser)
    return {
        a.dest: next((s for s in a.option_strings if s.startswith("--")), a.option_strings[0])
        for a in group._group_actions
        if a.option_strings
    }


def defaults(name: str, command: str) -> argparse.Namespace:
    """A Namespace of plugin ``name``'s flag defaults for ``command``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(name, command, parser)
    return parser.parse_args([])


def activate(name: str, command: str, args: argparse.Namespace) -> Any:
    """Activate plugin ``name``; errors become ``PluginError`` with a clear text.

    What the plugin's ``activate`` returns (its validated options) is kept
    and handed back to it by ``first``. The host's patches are installed by
    the caller (``integration.activate``).
    """
    from . import compat

    compat.check()
    plugin = load(name)
    if name in STATE.active:
        return plugin
    try:
        options = call(plugin, "activate", command=command, args=args)
    except PluginError:
        raise
    except Exception as e:
        log.debug("activation of %s failed", name, exc_info=True)
        raise ActivationFailed(f"plugin '{name}' failed to activate: {e}") from e
    STATE.active[name] = Active(plugin, command, args, options)
    return plugin


def _active_calls(hookname: str, kwargs: Dict[str, Any], first: bool = False):
    """``(name, call)`` for each active plugin implementing ``hookname``, in
    activation order; each call passes that plugin's own options.

    ``first``: how the caller asks, checked against ``hookspecs.FIRST_RESULT``
    so that a hook's declared kind is how the host calls it.
    """
    if first != (hookname in hookspecs.FIRST_RESULT):
        how = "plugins.first" if hookname in hookspecs.FIRST_RESULT else "collect or each"
        raise TypeError(f"hook {hookname!r} is asked with {how} (hookspecs.FIRST_RESULT)")
    impls = {impl.plugin: impl for impl in getattr(manager().hook, hookname).get_hookimpls()}
    for name, entry in list(STATE.active.items()):
        impl = impls.get(entry.plugin)
        if impl is not None:
            args = dict(kwargs, options=entry.options)
            yield (
                name,
                functools.partial(
                    impl.function, **{k: args[k] for k in impl.argnames if k in args}
                ),
            )


def first(hookname: str, **kwargs: Any) -> Any:
    """The first non-None result of ``hookname`` among the active plugins.

    Each plugin gets its own validated options as ``options`` (if its
    implementation takes them); plugins are asked in activation order. Only
    for the hooks in ``hookspecs.FIRST_RESULT``.
    """
    for _, call in _active_calls(hookname, kwargs, first=True):
        result = call()
        if result is not None:
            return result
    return None


def collect(hookname: str, **kwargs: Any) -> List[Any]:
    """Every active plugin's result of ``hookname`` (None results left out).

    A plugin that raises costs only its own result (logged), never the caller.
    """
    out = []
    for name, call in _active_calls(hookname, kwargs):
        try:
            result = call()
        except Exception as e:
            log.warning("plugin '%s' failed in %s: %s", name, hookname, e)
            continue
        if result is not None:
            out.append(result)
    return out


def each(hookname: str, **kwargs: Any) -> Dict[str, Any]:
    """``{plugin name: result}`` of ``hookname`` for each active plugin implementing it.

    An exception a plugin raises is its result, for a caller that reports
    per plugin what failed (the status page) rather than only logging it.
    """
    out: Dict[str, Any] = {}
    for name, call in _active_calls(hookname, kwargs):
        try:
            out[name] = call()
        except Exception as e:
            out[name] = e
    return out


def active_implements(hookname: str) -> bool:
    """Whether an active plugin implements ``hookname``."""
    return implements(hookname, list(STATE.active))


def active() -> Dict[str, argparse.Namespace]:
    """``{name: args}`` of active plugins."""
    return {name: entry.args for name, entry in STATE.active.items()}


def deactivate(name: str) -> None:
    entry = STATE.active.pop(name, None)
    if entry is None:
        return
    try:
        call(entry.plugin, "deactivate")
    finally:
        manager().unregister(entry.plugin)


def python_args(name: str, options: Dict[str, Any]) -> argparse.Namespace:
    """Plugin ``name``'s defaults with ``options`` (keywords) applied, checked."""
    args = defaults(name, "python")
    for key, value in options.items():
        if not hasattr(args, key):
            known = ", ".join(sorted(vars(args))) or "none"
            raise PluginError(f"plugin '{name}' has no option '{key}' (options: {known})")
        setattr(args, key, value)
    return args


def missing_folder(value: Any) -> bool:
    """Whether a ``--model`` / ``--data`` value can only name a local path and
    names nothing: mlx-lm would hand it to the Hugging Face client, whose
    error is about repo ids or a missing package. A value that may be a
    repo id (``NAME`` or ``OWNER/NAME``) is left to mlx-lm."""
    if not isinstance(value, str) or os.path.exists(value):
        return False
    return value.startswith(("/", ".", "~")) or value.count("/") > 1 or "\\" in value


def fail(message: str, status: int = 2) -> NoReturn:
    """Exit as argparse does for bad input, without a traceback."""
    print(f"mlx-lm-ext: error: {message}", file=sys.stderr)
    raise SystemExit(status)
