"""How mlx-lm-ext sits inside mlx-lm's commands, without modifying mlx-lm.

``patch(module)`` runs right after ``mlx_lm.generate``, ``mlx_lm.server`` or
``mlx_lm.lora`` is imported (see ``_boot``). It only teaches the command's
parser ``--plugin`` (and lora ``--loss``); everything else is patched when a
plugin is activated (``on_activate``), so a command where no plugin is named
runs mlx-lm's own code. Facts and line numbers behind each patch:
``shared/docs/mlx-lm-0.32-integration-map.md``.
"""

import argparse
import functools
import logging
import sys

from . import PluginError, plugins

log = logging.getLogger("mlx_lm_ext")

SERVER_DESCRIPTION = "MLX Http Server."

# Parsed command line of the running mlx-lm command ("generate", "server",
# "lora"), shared by every plugin named on it.
_cli_args = {}
# Patches installed on activation: key -> function that undoes it.
_undo = {}


# --------------------------------------------------------------- parsers


def _named_plugins(argv, command):
    """Plugins named on the command line, read before the real parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append")
    if command == "lora":
        pre.add_argument("--loss")
    known, _ = pre.parse_known_args(argv)
    names = plugins.split_names(known.plugin)
    loss = getattr(known, "loss", None)
    # An unknown loss is reported by lora's run(), after its YAML merge.
    if loss in plugins.installed() and loss not in names:
        names.append(loss)
    return names


def _plugin_help():
    names = sorted(plugins.installed())
    have = ", ".join(names) if names else "none"
    return (
        f"Enable an mlx-lm-ext plugin (repeatable or comma-separated; "
        f"installed: {have}). Put --help after --plugin NAME to see its flags."
    )


def extend_parser(parser, command):
    """Add ``--plugin`` (and lora ``--loss``); named plugins add their groups.

    The plugins' flags are added inside ``parse_args``, once the names are
    known, so they show in ``--help`` and are parsed by mlx-lm's own parser.
    """
    if getattr(parser, "_mlx_lm_ext", False):
        return parser
    parser._mlx_lm_ext = True
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
        names = _named_plugins(argv, command)
        try:
            for name in names:
                plugins.check_command(name, command)
                plugins.add_arguments(name, command, parser)
        except PluginError as e:
            plugins.fail(str(e))  # one line, not argparse's whole usage block
        ns = original(args, namespace)
        if command != "lora":  # lora activates after its YAML merge (run)
            _activate_cli(names, command, ns, plugins.fail)
        return ns

    parser.parse_args = parse_args
    return parser


def _activate_cli(names, command, args, error):
    _cli_args[command] = args
    for name in names:
        try:
            plugins.activate(name, command, args)
        except plugins.ActivationFailed as e:
            plugins.fail(str(e), status=1)
        except PluginError as e:
            error(str(e))


# ---------------------------------------------------------- module patches


def patch(module):
    patcher = {
        "mlx_lm.generate": _patch_generate,
        "mlx_lm.server": _patch_server,
        "mlx_lm.lora": _patch_lora,
    }.get(module.__name__)
    if patcher is None or getattr(module, "_mlx_lm_ext_patched", False):
        return
    patcher(module)
    module._mlx_lm_ext_patched = True
    if "python" in _cli_args:  # plugins enabled from Python before this import
        on_activate("python")


def _patch_generate(mod):
    build = mod.setup_arg_parser

    @functools.wraps(build)
    def setup_arg_parser():
        return extend_parser(build(), "generate")

    mod.setup_arg_parser = setup_arg_parser


def _patch_lora(mod):
    build = mod.build_parser
    run = mod.run

    @functools.wraps(build)
    def build_parser():
        return extend_parser(build(), "lora")

    @functools.wraps(run)
    def run_with_plugins(args, training_callback=None):
        _activate_lora(args)
        return run(args, training_callback)

    mod.build_parser = build_parser
    mod.run = run_with_plugins


def _patch_server(mod):
    main = mod.main

    @functools.wraps(main)
    def main_with_plugins():
        # The server builds its parser inside main() and main() never returns,
        # so catch its parser by description and restore at once.
        cls = argparse.ArgumentParser
        original = cls.parse_args

        def parse_args(self, args=None, namespace=None):
            if self.description != SERVER_DESCRIPTION:
                return original(self, args, namespace)
            cls.parse_args = original
            extend_parser(self, "server")
            return self.parse_args(args, namespace)

        cls.parse_args = parse_args
        try:
            return main()
        finally:
            if cls.parse_args is parse_args:
                cls.parse_args = original

    mod.main = main_with_plugins


# ------------------------------------------------------------------- lora


def _activate_lora(args):
    names = plugins.split_names(getattr(args, "plugin", None))
    loss = getattr(args, "loss", None)
    installed = plugins.installed()
    if loss not in (None, "default"):
        if loss not in installed or "lora" not in plugins.extends(loss):
            losses = [n for n in sorted(installed) if "lora" in plugins.extends(n)]
            have = ", ".join(["default", *losses])
            plugins.fail(f"unknown loss '{loss}' (losses: {have})")
        if loss not in names:
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
    _activate_cli(names, "lora", args, plugins.fail)
    if loss not in (None, "default"):
        _install_loss(loss, args)


def _install_loss(name, args):
    mod = sys.modules["mlx_lm.lora"]
    made = {}

    def loss_for(model):
        # One loss per model: train and evaluate share its one-time checks.
        if id(model) not in made:
            fn = plugins.hook().make_loss(name=name, model=model, args=args)
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
            return fn(*a, **kw)

        return wrapper

    _replace(mod, "train", with_loss(mod.train), "lora.train")
    _replace(mod, "evaluate", with_loss(mod.evaluate), "lora.evaluate")


# ------------------------------------------------------- activation patches


def _replace(obj, attr, value, key):
    if key in _undo:
        return
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    _undo[key] = lambda: setattr(obj, attr, old)


def on_activate(command, args=None):
    """Install what the active plugins need, once.

    ``command`` is the mlx-lm command, or ``"python"`` for plugins enabled
    from user code: then each module's patches go in as soon as mlx-lm's
    module is imported (see ``patch``).
    """
    if command == "python" and args is not None:
        # Every plugin enabled from Python adds its options to one namespace.
        merged = _cli_args.setdefault("python", argparse.Namespace())
        vars(merged).update(vars(args))
    if plugins.implements("speculative_generate_step"):
        _install_dispatcher()
    if command == "generate" and plugins.implements("make_drafter"):
        _install_generate_drafter()
    if command == "server" or (command == "python" and "mlx_lm.server" in sys.modules):
        if plugins.implements("make_prompt_cache"):
            _install_prompt_cache()
        drafters = command == "server" and plugins.implements("make_drafter")
        if drafters or plugins.implements("model_loaded"):
            _install_model_hook()


def on_deactivate():
    """Undo what no active plugin needs any more (Python API)."""
    needs = {
        "generate.speculative_generate_step": ("speculative_generate_step",),
        "generate.generate": ("make_drafter",),
        "server.LRUPromptCache": ("make_prompt_cache",),
        "server.ModelProvider._load": ("make_drafter", "model_loaded"),
    }
    for key, hooknames in needs.items():
        if key in _undo and not any(plugins.implements(h) for h in hooknames):
            _undo.pop(key)()
    if not plugins.active():
        _cli_args.pop("python", None)


def _install_dispatcher():
    import importlib

    mod = importlib.import_module("mlx_lm.generate")
    original = mod.speculative_generate_step

    @functools.wraps(original)
    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
        if args:  # mlx-lm passes stream positionally
            kwargs["stream"] = args[0]
        gen = plugins.hook().speculative_generate_step(
            prompt=prompt, model=model, draft_model=draft_model, kwargs=kwargs
        )
        if gen is None:
            gen = original(prompt, model, draft_model, **kwargs)
        return gen

    _replace(mod, "speculative_generate_step", speculative_generate_step,
             "generate.speculative_generate_step")


def _install_generate_drafter():
    mod = sys.modules["mlx_lm.generate"]
    original = mod.generate

    @functools.wraps(original)
    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        try:
            drafter = plugins.hook().make_drafter(
                command="generate",
                model=model,
                tokenizer=tokenizer,
                draft_model=kwargs.get("draft_model"),
                args=_cli_args.get("generate"),
            )
        except PluginError as e:  # e.g. a drafter made for another model
            plugins.fail(str(e))
        if drafter is not None:
            kwargs["draft_model"] = drafter
        return original(model, tokenizer, prompt, verbose=verbose, **kwargs)

    _replace(mod, "generate", generate, "generate.generate")


def _install_prompt_cache():
    """``mlx_lm.server.LRUPromptCache`` becomes a subclass that asks the plugins.

    It keeps the class's signature and defaults; ``isinstance`` against it
    holds for whatever cache a plugin returns (that is a stock
    ``LRUPromptCache`` too), and user subclasses get mlx-lm's own cache.
    """
    mod = sys.modules["mlx_lm.server"]
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
                    cache = plugins.hook().make_prompt_cache(
                        args=_cli_args.get("server") or _cli_args.get("python"),
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
    _replace(mod, "LRUPromptCache", LRUPromptCache, "server.LRUPromptCache")


def _install_model_hook():
    """Tell plugins of each model the server loads; hand drafters to mlx-lm."""
    provider = sys.modules["mlx_lm.server"].ModelProvider
    original = provider._load

    @functools.wraps(original)
    def _load(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        command = "server" if "server" in _cli_args else "python"
        try:
            plugins.hook().model_loaded(
                command=command, model_key=self.model_key, model=self.model,
                draft_model=self.draft_model, tokenizer=self.tokenizer,
            )
        except Exception as e:
            log.warning("a plugin failed on the loaded model: %s", e)
        if command != "server" or not plugins.implements("make_drafter"):
            return result
        try:
            drafter = plugins.hook().make_drafter(
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

    _replace(provider, "_load", _load, "server.ModelProvider._load")


def prompt_cache_classes():
    """Cache classes the active plugins append to prompt caches (see the hook)."""
    return [cls for classes in plugins.hook().prompt_cache_classes() for cls in classes or ()]
