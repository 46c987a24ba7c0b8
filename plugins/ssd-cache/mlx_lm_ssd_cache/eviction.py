"""Removing entries: the byte cap (least recently used first) and superseded prefixes.

Runs on the writer thread. An entry leaves the index before its file is
removed, under the directory lock, so that a concurrent scan does not index it
again; removals go through ``safefs`` (never through a link, only the tier's
own names).
"""

from mlx_lm_ext import safefs

from .index import Entry
from .store import Space, Store, error_kind, on_disk


def make_room(store: Store, incoming: int) -> None:
    """Evict until an entry of ``incoming`` bytes fits under the cap."""
    enforce_cap(store, extra=incoming)


def enforce_cap(store: Store, extra: int = 0, keep: Entry | None = None) -> None:
    """Remove least recently used entries until the cap holds (``keep`` stays)."""
    stored = store.stored()
    total = sum(e.nbytes for _, e in stored) + extra
    for space, e in sorted(stored, key=lambda se: se[1].recency):
        if total <= store.max_bytes:
            break
        if e is keep:
            continue
        if delete(store, space, e):
            total -= e.nbytes
            store.count(evicted=1)


def supersede(store: Store, space: Space, entry: Entry) -> None:
    """A trimmable entry makes its stored prefixes redundant: remove them."""
    if not entry.trimmable:
        return
    with store.lock:
        older = [e for e in space.index.prefixes_of(entry.tokens) if e is not entry and on_disk(e)]
    for e in older:
        if delete(store, space, e):
            store.count(superseded=1)


def delete(store: Store, space: Space, entry: Entry) -> bool:
    """Remove ``entry`` from the index and its file; False if it was no longer indexed."""
    with store.dir_lock:
        with store.lock:
            if space.index.entries.get(entry.name) is not entry:
                return False
            space.index.remove(entry.name)
        try:
            with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
                remove_file(store, space, fd, entry.name)
        except OSError as e:
            path = space.path / entry.name
            store.warn("remove: " + error_kind(e), f"cannot remove {path}: {e}")
    return True


def remove_file(store: Store, space: Space, fd: int, name: str) -> bool:
    """Unlink ``name`` in the open namespace ``fd``; False if it was not removed."""
    try:
        return safefs.unlink(fd, name)
    except FileNotFoundError:
        return False
    except OSError as e:
        store.warn("remove: " + error_kind(e), f"cannot remove {space.path / name}: {e}")
        return False
