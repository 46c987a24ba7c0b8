"""What the host installs in ``mlx_lm.server`` for active plugins (owners ``server.*``).

* ``server.prompt_cache``: ``LRUPromptCache`` becomes a subclass that asks
  ``make_prompt_cache`` (same signature and defaults, ``isinstance`` holds);
* ``server.model``: after ``ModelProvider._load``, ``model_loaded`` for every
  plugin and ``make_drafter``; the drafter goes to the batched path when
  ``batch_generator`` takes it, else to the serial speculative path;
* ``server.batch``: the server's ``BatchGenerator`` from that factory, and
  each request's info dict visible to it while the request is inserted;
* ``server.requests``: each request's ``host.request_info()`` dict, the
  plugins' ``usage_fields`` in responses and their ``report_lines`` under
  the server's prompt-cache log lines.

All of it goes through the ledger in ``patching``; ``integration.on_activate``
decides what is needed. Besides, SIGTERM ends a server with plugins as
Ctrl-C does (``install_sigterm``), so that plugins' exit handlers run.
"""

import functools
import logging
import signal
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Tuple

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
            if drafter is not None and _batched(self, drafter):
                # The drafter rides the batched path: mlx-lm's own draft model,
                # if any, is not used, and requests stay batchable.
                self.draft_model = None
                self.is_batchable = True
            elif drafter is not None:
                # Leave model_key alone: load() compares it on every request.
                self.draft_model = drafter
                self.is_batchable = False
                install_prompt_progress()
            return result

        return _load

    patching.wrap("server.model", provider, "_load", make)


PROGRESS_S = 2.0  # how often a speculative prefill's progress is reported


def install_prompt_progress() -> None:
    """Prompt progress on the server's serial speculative path (owner ``server.model``).

    mlx-lm's ``stream_generate`` drops ``prompt_progress_callback`` when it
    has a draft model, so a drafter served one request at a time reported
    nothing during a long prefill: no "Prompt processing progress" log
    lines, no keepalives on a stream. ``mlx_lm.server.stream_generate`` gets
    it back: while the first token is pending, a watcher reads how far the
    target's cache has got and calls the server's own callback with
    ``(processed, total)``, as mlx-lm's plain path does.
    """
    mod = sys.modules["mlx_lm.server"]

    def make(original):
        @functools.wraps(original)
        def stream_generate(*args, **kwargs):
            gen = original(*args, **kwargs)
            progress, prompt = kwargs.get("prompt_progress_callback"), kwargs.get("prompt")
            if kwargs.get("draft_model") is None or progress is None or prompt is None:
                return gen
            return _with_progress(gen, progress, kwargs.get("prompt_cache") or [], len(prompt))

        return stream_generate

    patching.wrap("server.model", mod, "stream_generate", make)


def _with_progress(gen, progress, cache, total):
    """``gen``'s items, with ``progress(n, total)`` at its start, every
    ``PROGRESS_S`` while the cache fills, and at the first token."""
    layer = next((c for c in cache if isinstance(getattr(c, "offset", None), int)), None)
    start = layer.offset if layer is not None else 0
    lock, done = threading.Lock(), threading.Event()

    def watch():
        last = 0
        while not done.wait(PROGRESS_S):
            n = min(max(layer.offset - start, 0), total - 1)
            with lock:
                if n != last and not done.is_set():
                    progress(n, total)
                    last = n

    progress(0, total)
    if layer is not None:
        threading.Thread(target=watch, name="mlx_lm_ext-progress", daemon=True).start()
    try:
        for i, item in enumerate(gen):
            if i == 0:
                with lock:
                    done.set()
                progress(total, total)
            yield item
    finally:
        done.set()


# model id -> (weak reference to the model, factory from ``batch_generator``)
_batch_factories: Dict[int, Tuple[Any, Callable[..., Any]]] = {}


def _batched(provider: Any, drafter: Any) -> bool:
    """Ask ``batch_generator`` for a factory for this model and drafter; remember it."""
    _batch_factories.clear()
    mod = sys.modules["mlx_lm.server"]
    if not plugins.active_implements("batch_generator"):
        return False
    if getattr(provider.cli_args, "kv_bits", None) is not None:
        return False  # mlx-lm serves every request one at a time then: draft there
    if not all(hasattr(c, "merge") for c in mod.make_prompt_cache(provider.model)):
        return False
    try:
        factory = plugins.first(
            "batch_generator",
            model=provider.model,
            tokenizer=provider.tokenizer,
            drafter=drafter,
            args=provider.cli_args,
        )
    except Exception as e:
        log.warning("batch generator plugin failed, serving the drafter serially: %s", e)
        factory = None
    if factory is None:
        return False
    _batch_factories[id(provider.model)] = (weakref.ref(provider.model), factory)
    return True


def install_batching() -> None:
    """The server's ``BatchGenerator`` comes from the plugin's factory for its model.

    ``mlx_lm.server.BatchGenerator`` (a module global ``_generate`` calls)
    becomes a function that builds the factory's generator for a model
    ``_batched`` registered, and mlx-lm's own otherwise or if the factory
    fails. ``ResponseGenerator._next_request`` hands each request a queue
    that puts its info dict on the request's ``GenerationContext`` and makes
    it the generation thread's current request (``host.begin_request``), so
    the generator's ``insert_segments`` sees it.
    """
    mod = sys.modules["mlx_lm.server"]

    def make_batch_generator(stock):
        @functools.wraps(stock)
        def BatchGenerator(model, *args, **kwargs):
            ref, factory = _batch_factories.get(id(model), (None, None))
            if factory is not None and ref() is model:
                try:
                    return factory(model, *args, **kwargs)
                except Exception as e:
                    log.warning("batch generator plugin failed, using mlx-lm's own: %s", e)
            return stock(model, *args, **kwargs)

        return BatchGenerator

    def make_next_request(original):
        @functools.wraps(original)
        def _next_request(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            if isinstance(request, tuple) and len(request) == 3:
                rqueue, req, gen_args = request
                if not isinstance(rqueue, _RequestQueue):
                    request = (_RequestQueue(rqueue), req, gen_args)
            return request

        return _next_request

    patching.wrap("server.batch", mod, "BatchGenerator", make_batch_generator)
    patching.wrap("server.batch", mod.ResponseGenerator, "_next_request", make_next_request)


class _RequestQueue:
    """A request's response queue that carries the request's info dict."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.mlx_lm_ext: Dict[str, Any] = {}

    def put(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        if type(item).__name__ == "GenerationContext" and not hasattr(item, "mlx_lm_ext"):
            item.mlx_lm_ext = self.mlx_lm_ext
            host.begin_request(self.mlx_lm_ext)
        return self.queue.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def install_requests() -> None:
    """Per-request figures of plugins into ``usage``; plugins' lines into the cache log."""
    mod = sys.modules["mlx_lm.server"]
    handler_local = _HandlerLocal()

    def make_serve_single(original):
        @functools.wraps(original)
        def _serve_single(self, request, stream):
            rqueue, req, args = request
            if not isinstance(rqueue, _RequestQueue):  # install_batching's queue already is one
                rqueue = _RequestQueue(rqueue)
            with host.serving(rqueue.mlx_lm_ext):
                return original(self, (rqueue, req, args), stream)

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


def install_sigterm() -> None:
    """SIGTERM takes ``mlx_lm.server``'s Ctrl-C path instead of killing the process.

    On KeyboardInterrupt the server shuts its HTTP server down and joins the
    generation thread; the process then exits normally and exit handlers run
    (ssd-cache's pending writes, spec-decode's suffix corpus). Python's default
    SIGTERM ends the process without any of that. Only a default handler is
    replaced, from the main thread; a second SIGTERM kills as before.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.info("SIGTERM: shutting down as on Ctrl-C")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
