"""The one ledger of every change mlx-lm-ext makes to mlx-lm.

Only the core calls it. Each patch belongs to an *owner* (a short name of
the feature that needs it, e.g. ``"server.prompt_cache"``); ``undo(owner)``
puts back what that owner replaced, in reverse order. A second patch of the
same attribute by another owner is refused: two wrappers that do not know of
each other are how patched code goes wrong. ``patches()`` lists what is
patched now (``mlx-lm-ext doctor`` and the tests read it).

``OWNERS`` is the one table of what may be patched: each owner, the mlx-lm
attributes it patches and the core function that installs them. The ledger
refuses an owner or an attribute the table does not list;
``docs/core.md`` ("How mlx-lm is patched") lists the same rows with what each
wrapper does, and ``tests/test_hooks.py`` holds the table, the code and the
doc to one another and to the installed mlx-lm.
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Tuple


class PatchConflict(RuntimeError):
    """An attribute is already patched by another owner."""


class Owner(NamedTuple):
    """One row of the owner table."""

    owner: str  # who patches (the feature that needs it)
    attribute: str  # what, in mlx-lm 0.32.2: ``<arch>`` a model module, ``()`` on instances
    installer: str  # the core function that patches it (``module.function``)


OWNERS = (
    Owner("core", "mlx_lm.generate.setup_arg_parser", "integration._patch_generate"),
    Owner("core", "mlx_lm.lora.build_parser", "integration._patch_lora"),
    Owner("core", "mlx_lm.lora.run", "integration._patch_lora"),
    Owner("core", "mlx_lm.server.main", "integration._patch_server"),
    Owner("core.server-parser", "argparse.ArgumentParser.parse_args", "integration._patch_server"),
    Owner(
        "generate.dispatch",
        "mlx_lm.generate.speculative_generate_step",
        "integration._install_dispatcher",
    ),
    Owner("generate.generate", "mlx_lm.generate.generate", "integration._install_generate"),
    Owner(
        "python.generate", "mlx_lm.generate.stream_generate", "integration._install_python_generate"
    ),
    Owner("python.generate", "mlx_lm.stream_generate", "integration._install_python_generate"),
    Owner("server.prompt_cache", "mlx_lm.server.LRUPromptCache", "serving.install_prompt_cache"),
    Owner("server.model", "mlx_lm.server.ModelProvider._load", "serving.install_model_hook"),
    Owner("server.model", "mlx_lm.server.stream_generate", "serving.install_prompt_progress"),
    Owner("server.batch", "mlx_lm.server.BatchGenerator", "serving.install_batching"),
    Owner(
        "server.batch", "mlx_lm.server.ResponseGenerator._next_request", "serving.install_batching"
    ),
    Owner(
        "server.requests",
        "mlx_lm.server.ResponseGenerator._serve_single",
        "serving.install_requests",
    ),
    Owner(
        "server.requests", "mlx_lm.server.ResponseGenerator.generate", "serving.install_requests"
    ),
    Owner(
        "server.requests",
        "mlx_lm.server.ResponseGenerator._log_cache_stats",
        "serving.install_requests",
    ),
    Owner(
        "server.requests", "mlx_lm.server.APIHandler.generate_response", "serving.install_requests"
    ),
    Owner(
        "server.requests",
        "mlx_lm.server.APIHandler.completion_usage_response",
        "serving.install_requests",
    ),
    Owner("server.metrics", "mlx_lm.server.APIHandler.do_POST", "monitoring.install"),
    Owner(
        "server.metrics", "mlx_lm.server.APIHandler._set_completion_headers", "monitoring.install"
    ),
    Owner("server.metrics", "mlx_lm.server.APIHandler._set_stream_headers", "monitoring.install"),
    Owner(
        "server.metrics", "mlx_lm.server.ResponseGenerator._await_response", "monitoring.install"
    ),
    Owner("server.routes", "mlx_lm.server.APIHandler.do_GET", "monitoring.install"),
    Owner("server.routes", "mlx_lm.server._run_http_server", "monitoring.install"),
    Owner("lora.loss", "mlx_lm.lora.train", "training.install"),
    Owner("lora.loss", "mlx_lm.lora.evaluate", "training.install"),
    Owner("lora.data", "mlx_lm.lora.load_dataset", "training.install"),
    Owner("lora.report", "mlx_lm.tuner.trainer.TrainUI", "training._reports"),
    Owner(
        "attention",
        "mlx_lm.models.<arch>.scaled_dot_product_attention",
        "host.override_attention",
    ),
    Owner("rope", "mlx_lm.models.<arch>.Attention().rope", "host.override_rope"),
    Owner("flush", "mlx_lm.models.<arch>.LlamaModel().layers", "host.flush_layers"),
)

# owner -> the attribute names it may set (the ledger's check)
_ALLOWED: Dict[str, set] = {}
for _row in OWNERS:
    _ALLOWED.setdefault(_row.owner, set()).add(_row.attribute.rsplit(".", 1)[1])


def _check(owner: str, attr: str = "") -> None:
    if owner not in _ALLOWED:
        raise ValueError(f"unknown patch owner {owner!r}: list it in patching.OWNERS")
    if attr and attr not in _ALLOWED[owner]:
        raise ValueError(f"owner {owner!r} does not patch {attr!r} (patching.OWNERS)")


@dataclass
class Patch:
    owner: str
    obj: Any
    attr: str
    old: Any
    new: Any

    @property
    def where(self) -> str:
        name = getattr(self.obj, "__qualname__", None) or getattr(self.obj, "__name__", "?")
        module = getattr(self.obj, "__module__", None)
        if module and module != name and not isinstance(self.obj, type(contextlib)):
            name = f"{module}.{name}"
        return f"{name}.{self.attr}"


_lock = threading.RLock()
_ledger: Dict[Tuple[int, str], Patch] = {}


def replace(owner: str, obj: Any, attr: str, value: Any) -> Patch:
    """Set ``obj.attr = value`` for ``owner``; the same owner again is a no-op."""
    _check(owner, attr)
    with _lock:
        key = (id(obj), attr)
        held = _ledger.get(key)
        if held is not None:
            if held.owner == owner:
                return held
            raise PatchConflict(f"{held.where} is already patched by {held.owner}, not {owner}")
        patch = Patch(owner, obj, attr, getattr(obj, attr), value)
        setattr(obj, attr, value)
        _ledger[key] = patch
        return patch


def wrap(owner: str, obj: Any, attr: str, make: Callable[[Any], Any]) -> Patch:
    """Replace ``obj.attr`` by ``make(original)`` unless ``owner`` already did."""
    with _lock:
        held = _ledger.get((id(obj), attr))
        if held is not None and held.owner == owner:
            return held
        return replace(owner, obj, attr, make(getattr(obj, attr)))


def undo(owner: str) -> int:
    """Put back everything ``owner`` replaced; returns how many."""
    _check(owner)
    with _lock:
        mine = [k for k, p in _ledger.items() if p.owner == owner]
        for key in reversed(mine):
            p = _ledger.pop(key)
            setattr(p.obj, p.attr, p.old)
        return len(mine)


def owned(owner: str) -> bool:
    _check(owner)
    with _lock:
        return any(p.owner == owner for p in _ledger.values())


def patches() -> List[Patch]:
    with _lock:
        return list(_ledger.values())


@contextlib.contextmanager
def scoped(owner: str, items: List[Tuple[Any, str, Any]]) -> Iterator[None]:
    """Patch ``(obj, attr, value)`` items for the length of a ``with`` block.

    For changes that must hold only while one call runs (an attention
    function swapped for one forward pass), so they never outlive it.
    """
    done = []
    try:
        for obj, attr, value in items:
            done.append(replace(owner, obj, attr, value))
        yield
    finally:
        with _lock:
            for p in reversed(done):
                if _ledger.get((id(p.obj), p.attr)) is p:
                    del _ledger[(id(p.obj), p.attr)]
                    setattr(p.obj, p.attr, p.old)
