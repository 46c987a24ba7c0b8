"""Reading a namespace directory: identify a model's space, scan its entry headers.

A scan reads headers only. It indexes the entries that are checked against
the model's cache layout (the reference), sets aside the ones that are not
(``<name>.rejected``, kept a day for inspection), and reaps temp files whose
writer is gone (``safefs.reap``: no process holds the file's lock; its pid
is never trusted, another PID namespace cannot see it). Nothing here raises into the server: a directory that cannot be
listed or a file that cannot be read is a warning and a miss.
"""

import os
import time
from collections.abc import Callable

from mlx_lm_ext import safefs

from . import eviction, fileformat, identity, layout
from .commands import entries
from .index import Entry, PrefixIndex
from .store import Space, Store, entry_name, error_kind, log, on_disk

REJECTED_MAX_AGE = 86400.0  # entries set aside stay a day for inspection

# (model key, settings) -> (fingerprint, namespace, info), or Unidentifiable
Identify = Callable[[object, dict], tuple[str, str, dict]]


def space_for(store: Store, model_key, identify: Identify, block: int) -> Space | None:
    """``model_key``'s space, identified and scanned the first time it is asked for.

    None when the model has no disk tier (it cannot be identified, or the
    root is not safely a cache directory); that answer is remembered too.
    """
    try:
        return store.spaces[model_key]
    except KeyError:
        pass
    except TypeError:  # an unhashable key: not the server's
        return None
    with store.space_lock:
        if model_key not in store.spaces:
            store.spaces[model_key] = _identify(store, model_key, identify, block)
        return store.spaces[model_key]


def _identify(store, model_key, identify, block):
    try:
        fp, ns, info = identify(model_key, store.settings)
        path = store.root / fp / ns
        space = Space(fp, ns, path, info, PrefixIndex(block), model_key)
        for other in store.spaces.values():  # keys that name the same files
            if other is not None and other.path == path:
                space = other
                break
        else:
            scan(store, space)
        n = entries(len(space.index))
        log.info("ssd-cache: %s -> %s (%s on disk)", info.get("model"), path, n)
        return space
    except identity.Unidentifiable as e:
        store.warn(f"unidentifiable:{model_key!r}", f"no disk tier for {e}")
    except safefs.NotACache as e:
        store.warn("not a cache", f"no disk tier: {e}")
    except Exception as e:  # identification reads user files: never fatal
        store.warn("identify", f"no disk tier for {model_key!r}: {e!r}")
    return None


def refresh(store: Store, space: Space) -> None:
    """Rescan when the directory changed (another server wrote or removed)."""
    try:
        st = os.stat(space.path)
    except OSError:
        return
    if (st.st_mtime_ns, st.st_size) != space.seen:
        scan(store, space)


def scan(store: Store, space: Space) -> None:
    """Header-only scan of one directory: index good entries, set aside bad ones."""
    with store.dir_lock:
        try:
            with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
                st = os.fstat(fd)
                space.seen = (st.st_mtime_ns, st.st_size)
                found = _scan_files(store, space, fd)
        except FileNotFoundError:
            return
        except OSError as e:  # a link where a directory should be is refused here too
            store.warn("list: " + error_kind(e), f"cannot list {space.path}: {e}")
            return
        with store.lock:  # entries another process removed
            for name, e in list(space.index.entries.items()):
                if name not in found and on_disk(e):
                    space.index.remove(name)


def _scan_files(store, space, fd):
    """Index the new entries of an open directory; the names of all entries it holds."""
    found = set()
    ref = reference(store, space)
    for name, st in safefs.files(fd):
        if safefs.TEMP.fullmatch(name):
            _maybe_reap(fd, name)
        elif safefs.REJECTED.fullmatch(name):
            if time.time() - st.st_mtime > REJECTED_MAX_AGE:
                eviction.remove_file(store, space, fd, name)
        elif name in space.index.entries:
            found.add(name)
        else:
            entry = _read_entry(store, space, fd, name, ref)
            if entry is not None:
                found.add(name)
                with store.lock:
                    space.index.add(entry)
    return found


def _read_entry(store, space, fd, name, ref):
    try:
        header = fileformat.read_header(name, dir_fd=fd)
        check_header(store, space, header, name, ref)
    except OSError as e:
        if not isinstance(e, FileNotFoundError):
            store.warn("read: " + error_kind(e), f"cannot read {space.path / name}: {e}")
        return None
    except Exception as e:  # Corrupt, or anything else a crafted file provokes
        set_aside(store, space, fd, name, e)
        return None
    return Entry(name, header.tokens, header.trimmable, header.size, header.mtime)


def check_header(
    store: Store, space: Space, header: fileformat.Header, name: str, ref: layout.Reference | None
) -> None:
    """Raise ``Corrupt`` unless ``header`` is an entry of this space that the model can use."""
    meta = header.meta
    if meta.get("fingerprint") != space.fingerprint or meta.get("namespace") != space.namespace:
        raise fileformat.Corrupt("entry of another fingerprint or namespace")
    if entry_name(space.namespace, header.tokens) != name:
        raise fileformat.Corrupt("file name does not match its tokens")
    if header.size > store.max_bytes:
        raise fileformat.Corrupt(f"{header.size} bytes exceed the disk cap")
    if ref is None:
        raise fileformat.Corrupt("the model's cache layout is unknown")
    layout.validate(header, ref)


def reference(store: Store, space: Space) -> layout.Reference | None:
    """The caches the model makes: from the loaded model when the server has
    told us of it (exact dtypes), else from its config (random lazy weights)."""
    live = store.live_models(space.model_key)
    if space.ref is not None and (space.ref.exact_dtype or not live):
        return space.ref
    try:
        if live:
            space.ref = layout.reference(live, store.settings, exact_dtype=True)
        else:
            models = identity.lazy_models(space.model_key)
            space.ref = layout.reference(models, store.settings, exact_dtype=False)
    except Exception as e:  # an architecture that cannot be built from its config
        store.warn("layout", f"cache layout of {space.info.get('model')} unknown: {e!r}")
    return space.ref


def set_aside(store: Store, space: Space, fd: int, name: str, why: Exception) -> None:
    """Rename a bad entry to ``<name>.rejected``: never restored, kept a day."""
    store.warn("corrupt", f"set aside entry {space.path / name}: {why}")
    store.count(removed_corrupt=1)
    try:
        if safefs.ENTRY.fullmatch(name):
            safefs.rename(fd, name, name + ".rejected")
    except OSError:
        pass


def _maybe_reap(fd, name):
    """Remove a temp file whose writer is gone: unlocked, and untouched for a moment."""
    if safefs.reap(fd, name):
        log.info("ssd-cache: reaped unfinished write %s", name)
