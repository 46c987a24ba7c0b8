"""What the host installs in ``mlx_lm.server`` for active plugins (owners ``server.*``).

* ``server.prompt_cache``: ``LRUPromptCache`` becomes a subclass that asks
  ``make_prompt_cache`` (same signature and defaults, ``isinstance`` holds);
* ``server.model``: after ``ModelProvider._load``, ``model_loaded`` for every
  plugin and ``make_drafter`` for the serial speculative path;
* ``server.requests``: each request's ``host.request_info()`` dict, the
  plugins' ``usage_fields`` in responses and their ``report_lines`` under
  the server's prompt-cache log lines.

All of it goes through the ledger in ``patching``; ``integration.on_activate``
decides what is needed.
"""

import functools
import logging
import sys
import threading

from . import host, patching, plugins

log = logging.getLogger("mlx_lm_ext")
STATE = plugins.STATE


def install_prompt_cache() -> None:
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


def install_model_hook() -> None:
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
            if command != "server" or not plugins.active_implements("make_drafter"):
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


def install_requests() -> None:
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
