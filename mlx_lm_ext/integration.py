"""How mlx-lm-ext sits inside mlx-lm's commands, without modifying mlx-lm's files.

``patch(module)`` runs right after ``mlx_lm.generate``, ``mlx_lm.server`` or
``mlx_lm.lora`` is imported (see ``_boot``). It only teaches the command's
parser ``--plugin`` (and lora ``--loss``); everything else is installed when
a plugin is activated (``on_activate``), so a command where no plugin is
named runs mlx-lm's own code. Every change to mlx-lm goes through the ledger
in ``patching`` under an owner named here; ``docs/core.md`` lists
them with the mlx-lm facts each one relies on.
"""

import argparse
import functools
import logging
import os
import sys
from types import ModuleType
from typing import Any, Dict, Iterable, List, Optional

from . import PluginError, host, patching, plugins, serving

log = logging.getLogger("mlx_lm_ext")

SERVER_DESCRIPTION = "MLX Http Server."
STATE = plugins.STATE


# --------------------------------------------------------------- parsers


def _prescan(argv, command):
    """``(plugin names, loss)`` named on the command line, before the real parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append")
    if command == "lora":
        pre.add_argument("--loss")
    known, _ = pre.parse_known_args(argv)
    return plugins.split_names(known.plugin), getattr(known, "loss", None)


def loss_plugin(loss: Optional[str]) -> Optional[str]:
    """The plugin behind ``--loss NAME`` (None for mlx-lm's own); exits 2 if none."""
    if loss in (None, "default"):
        return None
    provider = plugins.loss_provider(loss)
    if provider is None:
        plugins.fail(plugins.unknown_loss_message(loss))
    return provider


def _plugin_help():
    names = sorted(plugins.installed())
    have = ", ".join(names) if names else "none"
    return (
        f"Enable an mlx-lm-ext plugin (repeatable or comma-separated; "
        f"installed: {have}). Put --help after --plugin NAME to see its flags."
    )


def extend_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """Add ``--plugin`` (and lora ``--loss``); named plugins add their groups.

    The plugins' flags are added inside ``parse_args``, once the names are
    known, so they show in ``--help`` and are parsed by mlx-lm's own parser.
    """
    if any(a.dest == "plugin" for a in parser._actions):
        return parser
    parser.add_argument(
        "--plugin", action="append", default=None, metavar="NAME", help=_plugin_help()
    )
    if command == "server":
        parser.add_argument(
            "--no-status",
            action="store_true",
            help="With a --plugin: leave out the /metrics, /status and /status.json "
            "routes and the request figures behind them.",
        )
        parser.add_argument(
            "--status-show-paths",
            action="store_true",
            help="Show full paths (the model folder, plugin options) on /status and "
            "/status.json to any client; by default only a loopback-bound server "
            "shows them, to requests for a loopback name.",
        )
    if command == "lora":
        parser.add_argument(
            "--loss",
            default=None,
            metavar="NAME",
            help="Training loss: 'default' (mlx-lm's) or one from a plugin, "
            "e.g. flash-cce. Also `loss: NAME` in the YAML config.",
        )

    def parse_args(args=None, namespace=None):
        argv = sys.argv[1:] if args is None else args
        names, loss = _prescan(argv, command)
        # A loss named here brings its flags; an unknown one is reported by
        # lora's run(), after its YAML merge (the YAML may name the loss).
        provider = None if loss in (None, "default") else plugins.loss_provider(loss)
        if provider is not None and provider not in names:
            names.append(provider)
        try:
            for name in names:
                plugins.check_command(name, command)
                plugins.add_arguments(name, command, parser)
        except PluginError as e:
            plugins.fail(str(e))  # one line, not argparse's whole usage block
        ns, extra = parser.parse_known_args(args, namespace)  # what original() does, then:
        if extra:  # a flag of a plugin not named says which (exit 2)
            plugins.unrecognized(parser, extra, command, names)
        if names:
            _check_model_folders(ns)
        if command != "lora":  # lora activates after its YAML merge (run)
            activate_cli(names, command, ns)
        return ns

    parser.parse_args = parse_args  # the parser object mlx-lm just built, not mlx-lm
    return parser


def _check_model_folders(ns: argparse.Namespace) -> None:
    """A ``--model`` / ``--draft-model`` naming a local folder that is not there exits 2."""
    for dest in ("model", "draft_model"):
        value = getattr(ns, dest, None)
        if plugins.missing_folder(value):
            plugins.fail(f"--{dest.replace('_', '-')} {value}: no such folder")


def activate_cli(names: Iterable[str], command: str, args: argparse.Namespace) -> None:
    """Activate the named plugins for a command line; exit 2 (1) on bad input (a crash)."""
    STATE.args[command] = args
    for name in names:
        try:
            plugins.activate(name, command, args)
        except plugins.ActivationFailed as e:
            plugins.fail(str(e), status=1)
        except PluginError as e:
            plugins.fail(str(e))
    on_activate(command)


def enable(name: str, **options: Any) -> Any:
    """Python API (``mlx_lm_ext.enable``, which has checked ``MLX_LM_EXT_DISABLE``)."""
    args = plugins.python_args(name, option_values(name, options))
    plugin = plugins.activate(name, "python", args)
    # Every plugin enabled from Python adds its options to one namespace.
    vars(STATE.args.setdefault("python", argparse.Namespace())).update(vars(args))
    on_activate("python")
    return plugin


def disable(name: str) -> None:
    plugins.deactivate(name)
    on_deactivate()


def option_values(name: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` (keywords of ``enable``) checked as the command line checks
    its flags: a choice must be one of the choices, a switch True or False, a
    typed value of its type (a string goes through the flag's own type, as
    on the command line). Unknown names are left to ``plugins.python_args``."""
    parser = argparse.ArgumentParser(add_help=False)
    plugins.add_arguments(name, "python", parser)
    actions = {a.dest: a for a in parser._actions}
    out = {}
    for key, value in options.items():
        action = actions.get(key)
        out[key] = value if action is None else _option_value(name, key, action, value)
    return out


def _option_value(name: str, key: str, action: argparse.Action, value: Any) -> Any:
    def bad(why: str) -> PluginError:
        return PluginError(f"plugin '{name}': {key}={value!r}: {why}")

    if action.nargs == 0:  # a switch (store_true, store_false, --x/--no-x)
        if not isinstance(value, bool):
            raise bad("must be True or False")
        return value
    if (value is None and action.default is None) or action.nargs not in (None, "?"):
        return value  # left unset as on the command line; lists are the plugin's to check
    kind = action.type if callable(action.type) else str
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(value, str) and kind is not str:
        try:  # what the command line does with the text of a flag
            value = kind(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            what = {int: "an integer", float: "a number"}.get(kind)
            raise bad(f"must be {what}" if what else str(e) or "not a valid value") from e
    elif kind is int and not (number and isinstance(value, int)):
        raise bad("must be an integer")
    elif kind is float and not number:
        raise bad("must be a number")
    elif kind is str:
        if isinstance(value, os.PathLike) or number:
            value = str(value)  # the text the command line would have passed
        elif not isinstance(value, str):
            raise bad("must be a string")
    if action.choices is not None and value not in action.choices:
        raise bad(f"must be one of {', '.join(map(str, action.choices))}")
    return value


# ---------------------------------------------------------- module patches


def patch(module: ModuleType) -> None:
    """Teach a freshly imported mlx-lm command module ``--plugin`` (owner "core")."""
    patcher = {
        "mlx_lm.generate": _patch_generate,
        "mlx_lm.server": _patch_server,
        "mlx_lm.lora": _patch_lora,
    }.get(module.__name__)
    if patcher is None:
        return
    patcher(module)
    if "python" in STATE.args:  # plugins enabled from Python before this import
        on_activate("python")


def _patch_generate(mod):
    def make(build):
        @functools.wraps(build)
        def setup_arg_parser():
            return extend_parser(build(), "generate")

        return setup_arg_parser

    patching.wrap("core", mod, "setup_arg_parser", make)


def _patch_lora(mod):
    def make_build(build):
        @functools.wraps(build)
        def build_parser():
            return extend_parser(build(), "lora")

        return build_parser

    def make_run(run):
        @functools.wraps(run)
        def run_with_plugins(args, training_callback=None):
            _activate_lora(args)
            return run(args, training_callback)

        return run_with_plugins

    patching.wrap("core", mod, "build_parser", make_build)
    patching.wrap("core", mod, "run", make_run)


def _patch_server(mod):
    def make(main):
        @functools.wraps(main)
        def main_with_plugins():
            # The server builds its parser inside main() and main() never
            # returns, so catch its parser by description and restore at once.
            cls = argparse.ArgumentParser
            original = cls.parse_args

            def parse_args(self, args=None, namespace=None):
                if self.description != SERVER_DESCRIPTION:
                    return original(self, args, namespace)
                patching.undo("core.server-parser")
                extend_parser(self, "server")
                return self.parse_args(args, namespace)

            patching.replace("core.server-parser", cls, "parse_args", parse_args)
            try:
                return main()
            finally:
                patching.undo("core.server-parser")

        return main_with_plugins

    patching.wrap("core", mod, "main", make)


# ------------------------------------------------------------------- lora


def _activate_lora(args):
    names = plugins.split_names(getattr(args, "plugin", None))
    provider = loss_plugin(getattr(args, "loss", None))
    if provider is not None and provider not in names:
        names.append(provider)
    for name in names:
        try:
            plugins.check_command(name, "lora")
            # Plugins named only in the YAML config had no flags on the parser.
            for key, value in vars(plugins.defaults(name, "lora")).items():
                if getattr(args, key, None) is None:
                    setattr(args, key, value)
        except PluginError as e:
            plugins.fail(str(e))
    activate_cli(names, "lora", args)
    if provider is not None:
        from . import training  # imports mlx: only for a lora run with a plugin's loss

        training.install(args.loss, args)


# ------------------------------------------------------- activation patches

# owner -> hooks that keep it installed (``on_deactivate`` undoes the rest)
NEEDS = {
    "generate.dispatch": ("speculative_generate_step",),
    "generate.generate": ("make_drafter", "report_lines"),
    "python.generate": ("make_drafter",),
    "server.prompt_cache": ("make_prompt_cache",),
    "server.model": ("make_drafter", "model_loaded"),
    "server.batch": ("batch_generator",),
    "server.requests": ("usage_fields", "report_lines"),
}


def on_activate(command: str) -> None:
    """Install what the active plugins need, once.

    ``command`` is the mlx-lm command, or ``"python"`` for plugins enabled
    from user code: then each module's patches go in as soon as mlx-lm's
    module is imported (see ``patch``).
    """
    if plugins.active_implements("speculative_generate_step"):
        _install_dispatcher()
    if command == "generate" and (
        plugins.active_implements("make_drafter") or plugins.active_implements("report_lines")
    ):
        _install_generate()
    if (
        command == "python"
        and "mlx_lm.generate" in sys.modules
        and plugins.active_implements("make_drafter")
    ):
        _install_python_generate()
    if command == "server" or (command == "python" and "mlx_lm.server" in sys.modules):
        if plugins.active_implements("make_prompt_cache"):
            serving.install_prompt_cache()
        if (
            command == "server" and plugins.active_implements("make_drafter")
        ) or plugins.active_implements("model_loaded"):
            serving.install_model_hook()
        if command == "server" and plugins.active_implements("batch_generator"):
            serving.install_batching()
        if plugins.active_implements("usage_fields") or plugins.active_implements("report_lines"):
            serving.install_requests()
    if command == "server" and STATE.active:
        serving.install_sigterm()
    args = STATE.args.get("server")
    if command == "server" and STATE.active and not getattr(args, "no_status", False):
        from . import monitoring  # imports prometheus_client: only for a server with plugins

        monitoring.install(args)


def on_deactivate() -> None:
    """Undo what no active plugin needs any more (Python API)."""
    for owner, hooknames in NEEDS.items():
        if not any(plugins.active_implements(h) for h in hooknames):
            patching.undo(owner)
    if not STATE.active:
        STATE.args.pop("python", None)


def _install_dispatcher():
    import importlib

    mod = importlib.import_module("mlx_lm.generate")

    def make(original):
        @functools.wraps(original)
        def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
            if args:  # mlx-lm passes stream positionally
                kwargs["stream"] = args[0]
            gen = plugins.first(
                "speculative_generate_step",
                prompt=prompt,
                model=model,
                drafter=draft_model,
                kwargs=kwargs,
            )
            if gen is None:
                gen = original(prompt, model, draft_model, **kwargs)
            return gen

        return speculative_generate_step

    patching.wrap("generate.dispatch", mod, "speculative_generate_step", make)


def _install_generate():
    """``mlx_lm.generate.generate``: the drafter goes in, plugins' report lines come out."""
    mod = sys.modules["mlx_lm.generate"]

    def make(original):
        @functools.wraps(original)
        def generate(model, tokenizer, prompt, verbose=False, **kwargs):
            try:
                drafter = plugins.first(
                    "make_drafter",
                    command="generate",
                    model=model,
                    tokenizer=tokenizer,
                    draft_model=kwargs.get("draft_model"),
                    args=STATE.args.get("generate"),
                )
            except PluginError as e:  # e.g. a drafter made for another model
                plugins.fail(str(e))
            if drafter is not None:
                kwargs["draft_model"] = drafter
            with host.serving({}) as info:
                text = original(model, tokenizer, prompt, verbose=verbose, **kwargs)
            if verbose:
                for lines in plugins.collect("report_lines", command="generate", source=info):
                    for line in lines:
                        print(line)
            return text

        return generate

    patching.wrap("generate.generate", mod, "generate", make)


def _install_python_generate():
    """``stream_generate`` for plugins enabled from Python, so that
    ``mlx_lm.generate(...)`` and ``mlx_lm.stream_generate(...)`` draft as
    ``--plugin`` makes them: a call without a ``draft_model`` gets the
    plugin's drafter (``make_drafter``, command ``"python"``, with the
    options given to ``enable``); the caller's own ``draft_model`` is the
    plugin's to keep or wrap. Patched where mlx-lm looks it up: its module
    (``generate`` calls it there) and the ``mlx_lm`` package. A name bound
    before ``enable`` (``from mlx_lm import stream_generate`` first) is
    mlx-lm's own function and stays stock."""
    mod = sys.modules["mlx_lm.generate"]

    def make(original):
        @functools.wraps(original)
        def stream_generate(
            model, tokenizer, prompt, max_tokens=256, draft_model=None, *args, **kwargs
        ):
            # mlx-lm's speculative path takes neither: such a call stays stock.
            plain = kwargs.get("input_embeddings") is not None or kwargs.get("max_kv_size")
            drafter = None
            if not plain:
                drafter = plugins.first(
                    "make_drafter",
                    command="python",
                    model=model,
                    tokenizer=tokenizer,
                    draft_model=draft_model,
                    args=None,
                )
            if drafter is not None:
                draft_model = drafter
            return original(model, tokenizer, prompt, max_tokens, draft_model, *args, **kwargs)

        return stream_generate

    patch = patching.wrap("python.generate", mod, "stream_generate", make)
    package = sys.modules.get("mlx_lm")
    # While mlx_lm/__init__ is still importing mlx_lm.generate, the package
    # has no stream_generate yet: it then takes the patched one by itself.
    if package is not None and getattr(package, "stream_generate", None) is patch.old:
        patching.replace("python.generate", package, "stream_generate", patch.new)


def prompt_cache_classes() -> List[type]:
    """Cache classes the active plugins append to prompt caches (see the hook)."""
    return [cls for classes in plugins.collect("prompt_cache_classes") for cls in classes]
