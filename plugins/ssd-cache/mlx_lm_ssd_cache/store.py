"""What the disk tier's parts share: a namespace's ``Space``, entry names, locks, counters.

``scan``, ``restore``, ``writer`` and ``eviction`` are functions over a
``Store`` and the ``Space`` they work on; ``disk.DiskTier`` owns both and is
the only one that decides what runs on which thread.
"""

import errno
import hashlib
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .fileformat import SUFFIX
from .index import Entry, PrefixIndex

log = logging.getLogger("mlx_lm_ssd_cache")

HOST = socket.gethostname()


@dataclass(eq=False)
class Space:
    """The entries of one ``<fingerprint>/<namespace>`` directory."""

    fingerprint: str
    namespace: str
    path: Path
    info: dict
    index: PrefixIndex
    model_key: object = None
    pending: int = 0  # entries in the index whose file is not written yet
    seen: object = None  # directory (mtime, size) at the last scan
    ref: object = None  # layout.Reference: the caches the model makes


def entry_name(namespace: str, tokens: Sequence[int] | np.ndarray) -> str:
    """The file name of the entry for ``tokens``: a hash, so that a name is never trusted."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.sha256(namespace.encode() + b"\0" + data).hexdigest()[:32] + SUFFIX


def on_disk(entry: Entry) -> bool:
    """Whether ``entry``'s file is written (a pending entry still holds its snapshot)."""
    return "snapshot" not in entry.extra


def error_kind(e: OSError) -> str:
    """A short kind for an OSError, so that each kind is warned about once."""
    return {
        errno.ENOSPC: "disk full",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOENT: "directory vanished",
    }.get(e.errno, f"I/O error ({errno.errorcode.get(e.errno, e.errno)})")


# Upper bounds (seconds) of the restore-time histogram ``metrics`` reports.
RESTORE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def new_counters() -> dict:
    return {
        "restore_buckets": [0] * len(RESTORE_BUCKETS),  # restores per bucket (not cumulative)
        "lookups": 0,
        "hits": 0,
        "restored_tokens": 0,
        "restore_s": 0.0,
        "last_restore_s": 0.0,
        "writes": 0,
        "written_bytes": 0,
        "write_s": 0.0,
        "skipped": 0,
        "failures": 0,
        "evicted": 0,
        "superseded": 0,
        "removed_corrupt": 0,
    }


@dataclass(eq=False)
class Store:
    """The tier's root and cap, its spaces, and the locks and counters over them.

    ``lock`` guards the indexes, the pending writes and the counters, and is
    never held during file I/O. It is re-entrant: a SIGTERM flush may run on a
    thread that was interrupted inside the tier (Python API use). ``dir_lock``
    is held by a scan and around each rename or removal, so that a scan never
    misses a file that the writer is about to index.
    """

    root: Path
    max_bytes: int
    settings: dict
    # model key -> [model, draft model] as loaded (None: not known here)
    live_models: Callable[[object], list | None]
    spaces: dict = field(default_factory=dict)  # model key -> Space, or None: no disk tier
    pending_bytes: int = 0
    counters: dict = field(default_factory=new_counters)
    lock: threading.RLock = field(default_factory=threading.RLock)
    dir_lock: threading.RLock = field(default_factory=threading.RLock)
    space_lock: threading.Lock = field(default_factory=threading.Lock)  # one identification
    warned: set = field(default_factory=set)

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` as a warning the first time its ``kind`` happens, then at debug."""
        if kind in self.warned:
            log.debug("ssd-cache: %s", message)
        else:
            self.warned.add(kind)
            log.warning("ssd-cache: %s (further ones are logged at debug level)", message)

    def count(self, **deltas: float) -> None:
        with self.lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def forget(self, space: Space, name: str) -> None:
        """Drop an entry from the index (its file is unreadable or gone)."""
        with self.lock:
            space.index.remove(name)

    def live_spaces(self) -> set:
        with self.lock:
            return {s for s in self.spaces.values() if s is not None}

    def stored(self) -> list[tuple[Space, Entry]]:
        """Every entry whose file is written, with its space."""
        with self.lock:
            spaces = self.live_spaces()
            return [(s, e) for s in spaces for e in s.index.entries.values() if on_disk(e)]
