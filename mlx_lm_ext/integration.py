"""How mlx-lm-ext sits inside mlx-lm's commands, without modifying mlx-lm's files.

``patch(module)`` runs right after ``mlx_lm.generate``, ``mlx_lm.server`` or
``mlx_lm.lora`` is imported (see ``_boot``). It only teaches the command's
parser ``--plugin`` (and lora ``--loss``); everything else is installed when
a plugin is activated (``on_activate``), so a command where no plugin is
named runs mlx-lm's own code. Every change to mlx-lm goes through the ledger
in ``patching`` under an owner named here; ``docs/architecture.md`` lists
them with the mlx-lm facts each one relies on.
"""

import argparse
import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Iterable, List, Optional

from . import PluginError, host, patching, plugins

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
    installed = plugins.installed()
    if loss not in installed or "lora" not in plugins.extends(loss):
        losses = [n for n in sorted(installed) if "lora" in plugins.extends(n)]
        plugins.fail(f"unknown loss '{loss}' (losses: {', '.join(['default', *losses])})")
    return loss


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
    if command == "lora":
        parser.add_argument(
            "--loss",
            default=None,
            metavar="NAME",
            help="Training loss: 'default' (mlx-lm's) or one from a plugin, "
            "e.g. flash-cce. Also `loss: NAME` in the YAML config.",
        )
    original = parser.parse_args

    def parse_args(args=None, namespace=None):
        argv = sys.argv[1:] if args is None else args
        names, loss = _prescan(argv, command)
        # A loss named here brings its flags; an unknown one is reported by
        # lora's run(), after its YAML merge (the YAML may name the loss).
        if loss not in (None, "default") and loss in plugins.installed() and loss not in names:
            names.append(loss)
        try:
            for name in names:
                plugins.check_command(name, command)
                plugins.add_arguments(name, command, parser)
        except PluginError as e:
            plugins.fail(str(e))  # one line, not argparse's whole usage block
        ns = original(args, namespace)
        if command != "lora":  # lora activates after its YAML merge (run)
            activate_cli(names, command, ns)
        return ns

    parser.parse_args = parse_args  # the parser object mlx-lm just built, not mlx-lm
    return parser


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
    """Python API (``mlx_lm_ext.enable``); ``MLX_LM_EXT_DISABLE=1`` wins."""
    import os

    if os.environ.get("MLX_LM_EXT_DISABLE", "") not in ("", "0"):
        log.warning("mlx-lm-ext: MLX_LM_EXT_DISABLE is set; plugin '%s' not enabled", name)
        return None
    args = plugins.python_args(name, options)
    plugin = plugins.activate(name, "python", args)
    # Every plugin enabled from Python adds its options to one namespace.
    vars(STATE.args.setdefault("python", argparse.Namespace())).update(vars(args))
    on_activate("python")
    return plugin


def disable(name: str) -> None:
    plugins.deactivate(name)
    on_deactivate()


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
    loss = loss_plugin(getattr(args, "loss", None))
    if loss is not None and loss not in names:
        names.append(loss)
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
    if loss is not None:
        _install_loss(loss, args)


def _install_loss(name, args):
    mod = sys.modules["mlx_lm.lora"]
    made = {}

    def loss_for(model):
        # One loss per model: train and evaluate share its one-time checks.
        if id(model) not in made:
            fn = plugins.first("make_loss", name=name, model=model, args=args)
            if fn is None:
                plugins.fail(f"no active plugin provides the loss '{name}'")
            made[id(model)] = fn
        return made[id(model)]

    def with_loss(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if kw.get("loss") is None:
                model = kw.get("model", a[0] if a else None)
                kw["loss"] = loss_for(model)
            try:
                return fn(*a, **kw)
            except PluginError as e:  # bad input found on the first batch: exit 2, one line
                plugins.fail(str(e))

        return wrapper

    patching.wrap("lora.loss", mod, "train", with_loss)
    patching.wrap("lora.loss", mod, "evaluate", with_loss)


# ------------------------------------------------------- activation patches

# owner -> hooks that keep it installed (``on_deactivate`` undoes the rest)
NEEDS = {
    "generate.dispatch": ("speculative_generate_step",),
    "generate.generate": ("make_drafter", "report_lines"),
    "server.prompt_cache": ("make_prompt_cache",),
    "server.model": ("make_drafter", "model_loaded"),
    "server.requests": ("usage_fields", "report_lines"),
}


def _implements(hookname):
    return plugins.implements(hookname, list(STATE.active))


def on_activate(command: str) -> None:
    """Install what the active plugins need, once.

    ``command`` is the mlx-lm command, or ``"python"`` for plugins enabled
    from user code: then each module's patches go in as soon as mlx-lm's
    module is imported (see ``patch``).
    """
    if _implements("speculative_generate_step"):
        _install_dispatcher()
    if command == "generate" and (_implements("make_drafter") or _implements("report_lines")):
        _install_generate()
    if command == "server" or (command == "python" and "mlx_lm.server" in sys.modules):
        if _implements("make_prompt_cache"):
            _install_prompt_cache()
        if (command == "server" and _implements("make_drafter")) or _implements("model_loaded"):
            _install_model_hook()
        if _implements("usage_fields") or _implements("report_lines"):
            _install_requests()


def on_deactivate() -> None:
    """Undo what no active plugin needs any more (Python API)."""
    for owner, hooknames in NEEDS.items():
        if not any(_implements(h) for h in hooknames):
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


def _install_prompt_cache():
    """``mlx_lm.server.LRUPromptCache`` becomes a subclass that asks the plugins.

    It keeps the class's signature and defaults; ``isinstance`` against it
    holds for whatever cache a plugin returns (that is a stock
    ``LRUPromptCache`` too), and user subclasses get mlx-lm's own cache.
    """
    mod = sys.modules["mlx_lm.server"]
    if patching.owned("server.prompt_cache"):
        return
    stock = mod.LRUPromptCache

    class _Meta(type(stock)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, stock)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, stock)

    class LRUPromptCache(stock, metaclass=_Meta):
        __doc__ = stock.__doc__

        def __new__(cls, max_size: int = 10, max_bytes: int = 1 << 63):
            if cls is LRUPromptCache:
                try:
                    cache = plugins.first(
                        "make_prompt_cache",
                        args=STATE.args.get("server") or STATE.args.get("python"),
                        max_size=max_size,
                        max_bytes=max_bytes,
                    )
                except Exception as e:
                    log.warning("prompt cache plugin failed, using mlx-lm's own: %s", e)
                    cache = None
                if cache is not None:
                    return cache  # not an instance of cls: __init__ is not run again
            return super().__new__(cls)

    LRUPromptCache.__module__ = stock.__module__
    LRUPromptCache.__qualname__ = stock.__qualname__
    patching.wrap("server.prompt_cache", mod, "LRUPromptCache", lambda _: LRUPromptCache)


def _install_model_hook():
    """Tell plugins of each model the server loads; hand drafters to mlx-lm."""
    provider = sys.modules["mlx_lm.server"].ModelProvider

    def make(original):
        @functools.wraps(original)
        def _load(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            command = "server" if "server" in STATE.args else "python"
            plugins.collect(
                "model_loaded",
                command=command,
                model_key=self.model_key,
                model=self.model,
                draft_model=self.draft_model,
                tokenizer=self.tokenizer,
            )
            if command != "server" or not _implements("make_drafter"):
                return result
            try:
                drafter = plugins.first(
                    "make_drafter",
                    command="server",
                    model=self.model,
                    tokenizer=self.tokenizer,
                    draft_model=self.draft_model,
                    args=self.cli_args,
                )
            except Exception as e:
                log.warning("drafter plugin failed, serving without it: %s", e)
                drafter = None
            if drafter is not None:
                # Leave model_key alone: load() compares it on every request.
                self.draft_model = drafter
                self.is_batchable = False
            return result

        return _load

    patching.wrap("server.model", provider, "_load", make)


def _install_requests():
    """Per-request figures of plugins into ``usage``; plugins' lines into the cache log."""
    mod = sys.modules["mlx_lm.server"]
    handler_local = _HandlerLocal()

    def make_serve_single(original):
        @functools.wraps(original)
        def _serve_single(self, request, stream):
            rqueue, req, args = request
            info = {}

            class Queue:  # the request's context object carries its plugin figures
                def put(self, item, *a, **kw):
                    if type(item).__name__ == "GenerationContext":
                        item.mlx_lm_ext = info
                    return rqueue.put(item, *a, **kw)

            with host.serving(info):
                return original(self, (Queue(), req, args), stream)

        return _serve_single

    def make_generate(original):
        @functools.wraps(original)
        def generate(self, *a, **kw):
            ctx, it = original(self, *a, **kw)
            handler_local.ctx = ctx  # this handler thread's current request
            return ctx, it

        return generate

    def make_response(original):
        @functools.wraps(original)
        def with_usage(self, *a, **kw):
            resp = original(self, *a, **kw)
            info = getattr(getattr(handler_local, "ctx", None), "mlx_lm_ext", None)
            if info and isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
                for fields in plugins.collect("usage_fields", info=info):
                    resp["usage"].update(fields)
            return resp

        return with_usage

    def make_log(original):
        @functools.wraps(original)
        def _log_cache_stats(self):
            original(self)
            for lines in plugins.collect(
                "report_lines", command="server", source=self.prompt_cache
            ):
                for line in lines:
                    logging.info(line)  # mlx-lm logs these lines on the root logger

        return _log_cache_stats

    rg, handler = mod.ResponseGenerator, mod.APIHandler
    patching.wrap("server.requests", rg, "_serve_single", make_serve_single)
    patching.wrap("server.requests", rg, "generate", make_generate)
    patching.wrap("server.requests", rg, "_log_cache_stats", make_log)
    patching.wrap("server.requests", handler, "generate_response", make_response)
    patching.wrap("server.requests", handler, "completion_usage_response", make_response)


class _HandlerLocal(threading.local):
    ctx = None


def prompt_cache_classes() -> List[type]:
    """Cache classes the active plugins append to prompt caches (see the hook)."""
    return [cls for classes in plugins.collect("prompt_cache_classes") for cls in classes]
