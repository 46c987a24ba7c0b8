"""The one ledger of every change mlx-lm-ext makes to mlx-lm.

Only the core calls it. Each patch belongs to an *owner* (a short name of
the feature that needs it, e.g. ``"server.prompt_cache"``); ``undo(owner)``
puts back what that owner replaced, in reverse order. A second patch of the
same attribute by another owner is refused: two wrappers that do not know of
each other are how patched code goes wrong. ``patches()`` lists what is
patched now (``mlx-lm-ext doctor`` and the tests read it).
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple


class PatchConflict(RuntimeError):
    """An attribute is already patched by another owner."""


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
    with _lock:
        mine = [k for k, p in _ledger.items() if p.owner == owner]
        for key in reversed(mine):
            p = _ledger.pop(key)
            setattr(p.obj, p.attr, p.old)
        return len(mine)


def owned(owner: str) -> bool:
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
