"""Turning an index entry back into a prompt cache, from its snapshot or its file.

A pending entry is restored from the snapshot still on its way to disk. A file
is checked again before its tensors are read (header, layout, tokens), since
it may have changed since it was indexed, and with ``verify`` its tensor data
against the header's CRC32s; a file that fails is forgotten and set aside,
and the caller tries its next best entry.
"""

from collections.abc import Callable, Iterable

import numpy as np

from mlx_lm_ext import safefs

from . import fileformat, scan
from .index import Entry
from .store import Space, Store, error_kind, log

ExtraClasses = Callable[[], Iterable[type]]


def restore(
    store: Store, space: Space, entry: Entry, *, verify: bool, extra_classes: ExtraClasses
) -> tuple[list, bool] | None:
    """``(prompt cache, checked)`` of ``entry``, or None.

    The cache is the model's caches, then the known plugin caches; ``checked``
    says whether its tensor data is known to be what was stored: a snapshot
    (memory), or a file whose CRC32s were verified.
    """
    snap = entry.extra.get("snapshot")
    if snap is not None:  # still on its way to disk
        return with_extras(*fileformat.from_snapshot(snap), extra_classes), True
    try:
        with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
            cache = _load(store, space, entry, fd, verify, extra_classes)
            return None if cache is None else (cache, verify)
    except OSError as e:
        store.forget(space, entry.name)  # until a rescan finds it readable
        store.warn("read: " + error_kind(e), f"cannot open {space.path}: {e}")
    return None


def _load(store, space, entry, fd, verify, extra_classes):
    """The prompt cache in ``entry``'s file in the open namespace ``fd``, or None."""
    path = space.path / entry.name
    try:
        header = fileformat.read_header(entry.name, dir_fd=fd)
        scan.check_header(store, space, header, entry.name, scan.reference(store, space))
        if not np.array_equal(header.tokens, entry.tokens):
            raise fileformat.Corrupt("tokens differ from the index")
        return with_extras(*fileformat.load(header, verify=verify, dir_fd=fd), extra_classes)
    except FileNotFoundError:
        store.forget(space, entry.name)
        store.warn("vanished", f"entry {path} vanished (removed by another process?)")
    except OSError as e:
        store.forget(space, entry.name)
        store.warn("read: " + error_kind(e), f"cannot read {path}: {e}")
    except Exception as e:  # Corrupt, or whatever else a crafted file provokes
        store.forget(space, entry.name)
        scan.set_aside(store, space, fd, entry.name, e)
    return None


def with_extras(caches: list, extras: list, extra_classes: ExtraClasses) -> list:
    """The model's caches plus the stored plugin caches this process knows.

    A plugin cache (a drafter's state) is rebuilt only by its own class,
    registered by its plugin; unknown ones are dropped, and the plugin
    that needs them makes fresh ones.
    """
    known = {c.__name__: c for c in extra_classes()}
    rebuilt = []
    for name, state, meta_state in extras:
        cls = known.get(name)
        if cls is None:
            return caches
        try:
            rebuilt.append(cls.from_state(state, meta_state))
        except Exception as e:
            log.debug("ssd-cache: stored %s not restored: %r", name, e)
            return caches
    return caches + rebuilt
