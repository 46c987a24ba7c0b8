"""What the host offers plugins while mlx-lm runs (they never patch mlx-lm).

* ``request_info()``: a dict for the request being generated on this
  thread (the server's generation thread, or a ``mlx_lm.generate`` call).
  A plugin records its per-request figures there; the host hands the dict
  to the plugins' ``usage_fields`` and ``report_lines`` hooks. On the
  server's batched path requests interleave: there it is the dict of the
  request the generation thread took in last, so inside a batch
  generator's ``insert_segments`` it is the request being inserted.
* ``override_attention(model, make)``: for the length of a ``with`` block,
  the attention function of ``model``'s modules is ``make(original)``
  (through the patch ledger, undone on exit).
* ``override_rope(modules, make)``: for the length of a ``with`` block,
  each of ``modules`` (``rope_modules(model)``: the attention modules that
  rotate with ``self.rope``) rotates with ``make(original)``.
* ``flush_layers(model, every)``: for the length of a ``with`` block, a
  forward of ``model`` hands every ``every``-th layer's output to
  ``mx.async_eval`` as soon as its graph is built.
"""

import contextlib
import itertools
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Optional

from . import patching

_local = threading.local()


def request_info() -> Optional[Dict[str, Any]]:
    """The current request's dict on this thread, or None outside a request."""
    return getattr(_local, "info", None)


@contextlib.contextmanager
def serving(info: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """Make ``info`` the current request's dict for the block (host side)."""
    previous = getattr(_local, "info", None)
    _local.info = info
    try:
        yield info
    finally:
        _local.info = previous


def begin_request(info: Dict[str, Any]) -> None:
    """Make ``info`` this thread's current request until the next one (host side).

    For the server's batched path, where no block spans one request.
    """
    _local.info = info


def last_request() -> Optional[Dict[str, Any]]:
    """The dict of the latest request this thread finished serving."""
    return getattr(_local, "last", None)


def finished(info: Dict[str, Any]) -> None:
    _local.last = info


_attention_modules: Dict[type, list] = {}


def _modules_of(model) -> list:
    """Modules defining ``scaled_dot_product_attention`` that ``model``'s layers use."""
    key = type(model)
    if key not in _attention_modules:
        names = {type(m).__module__ for m in model.modules()} | {type(model).__module__}
        _attention_modules[key] = [
            sys.modules[n]
            for n in sorted(names)
            if n in sys.modules
            and callable(getattr(sys.modules[n], "scaled_dot_product_attention", None))
        ]
    return _attention_modules[key]


@contextlib.contextmanager
def override_attention(model, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Run ``model``'s attention as ``make(original)`` inside the block."""
    mods = _modules_of(model)
    items = [
        (m, "scaled_dot_product_attention", make(m.scaled_dot_product_attention)) for m in mods
    ]
    with patching.scoped("attention", items):
        yield


def rope_modules(model) -> list:
    """``model``'s modules that hold their rotary embedding as ``rope`` (mlx-lm's layout)."""
    return [m for _, m in model.named_modules() if callable(m.get("rope"))]


@contextlib.contextmanager
def override_rope(modules: list, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Run each module's ``rope`` as ``make(original)`` inside the block."""
    with patching.scoped("rope", [(m, "rope", make(m["rope"])) for m in modules]):
        yield


class _Flushed:
    """A decoder layer whose output starts evaluating as soon as it is built."""

    def __init__(self, layer, flush):
        self.layer, self.flush = layer, flush

    def __getattr__(self, name):  # the model reads its layers' attributes (use_sliding, ...)
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.flush(out)
        return out


def _layers_holder(model):
    """The module whose ``layers`` list ``model.layers`` is, or None. In
    mlx-lm's layout that is the model or its ``model`` (checked first: this
    runs before every verify forward); otherwise any of its modules."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return None
    near = (model, model.get("model"))
    for m in itertools.chain(near, (m for _, m in model.named_modules())):
        if isinstance(m, dict) and m.get("layers") is layers:
            return m
    return None


@contextlib.contextmanager
def flush_layers(model, every: int) -> Iterator[None]:
    """Inside the block, ``model``'s forward hands every ``every``-th decoder
    layer's output to ``mx.async_eval`` as soon as its graph is built.

    An evaluation that waits for its result (a verify forward reads its
    logits back) otherwise starts only once the host has built the whole
    graph: the device idles while Python builds it. Flushed in stages, the
    device runs the first layers while the host builds the rest. ``every``
    of 0, or a model without mlx-lm's ``layers`` list, leaves it as it is."""
    holder = _layers_holder(model) if every > 0 else None
    if holder is None:
        yield
        return
    import mlx.core as mx  # here: importing this module stays cheap

    layers = list(holder["layers"])
    staged = [
        _Flushed(layer, mx.async_eval) if (i + 1) % every == 0 and i + 1 < len(layers) else layer
        for i, layer in enumerate(layers)
    ]
    with patching.scoped("flush", [(holder, "layers", staged)]):
        yield
