"""The disk tier: entry files per model fingerprint, an index, a writer thread.

Threads: ``put``, ``fetch`` and ``prepare`` run on the server's generation
thread; files are written, touched, superseded, evicted and rescanned by one
writer thread. The index and the counters are shared under the store's lock,
which is never held during file I/O. Nothing here raises into the server:
every I/O problem becomes a miss or "not stored", with one warning per kind of
problem.

The parts, each a module of functions over the shared ``store.Store``:
``scan`` (identify a model's directory, index its headers), ``restore`` (an
entry back to a prompt cache), ``writer`` (the thread and the file writes),
``eviction`` (the byte cap, superseded prefixes).

A cache restored from a file feeds every cache the server builds on it (the
longer prompts that share its prefix, in memory and on disk), so a restore
checks the tensor data against the header's CRC32s by default: a corrupt
file is a miss, not an answer. With ``verify=False`` restores are not
checked, and nothing that extends an unchecked restore is stored: the tier
never signs data it did not check with fresh checksums.
"""

import bisect
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import trim_prompt_cache

from . import fileformat, identity, restore, scan, writer
from .index import Entry
from .store import HOST, RESTORE_BUCKETS, Space, Store, entry_name, log, on_disk
from .writer import WRITE_RATE, flush_all

# Names the plugin, tests and benchmarks import from here.
__all__ = ["HOST", "WRITE_RATE", "DiskTier", "Space", "entry_name", "flush_all"]

RESCAN_INTERVAL = 30.0  # pick up entries other servers wrote into our directory


# The server options that change a cache's contents, at mlx_lm.server's
# defaults: a cache made without them (the Python API) finds a default
# server's entries, and a server's own settings keep their fingerprint.
SETTINGS_DEFAULTS = {
    "kv_bits": None,
    "kv_group_size": 64,
    "quantized_kv_start": DEFAULT_QUANTIZED_KV_START,
}


def server_settings(settings: dict | None) -> dict:
    """``settings`` with the unset server options at their defaults."""
    given = {k: v for k, v in (settings or {}).items() if v is not None}
    return {**SETTINGS_DEFAULTS, **given}


class DiskTier:
    """The disk tier under one server's prompt cache; thread-safe, never raises."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        *,
        verify: bool = True,
        writable: bool = True,
        settings: dict | None = None,
        block: int = 32,
        max_pending_bytes: int = 4 << 30,
        write_rate: int = WRITE_RATE,
        identify: scan.Identify = identity.identify,
        live_models: Callable[[object], list | None] | None = None,
        extra_classes: Callable[[], Iterable[type]] | None = None,
    ):
        """A tier under ``directory`` holding at most ``max_bytes`` of entries.

        ``live_models(key)`` gives ``[model, draft model]`` as loaded for a
        model key (None: not known here); ``extra_classes()`` the plugin cache
        classes that may ride after the model's caches. ``verify``: check
        every restored file's tensor CRC32s (off: restores are unchecked, and
        caches extending them are not stored). ``writable=False``: a directory
        that cannot be written (the plugin checks at start-up): entries are
        restored, nothing is stored or touched.
        """
        self.store = Store(
            root=Path(directory).expanduser(),
            max_bytes=int(max_bytes),
            settings=server_settings(settings),
            live_models=live_models or (lambda key: None),
        )
        self.verify = verify
        self.writable = writable
        # (fingerprint, namespace) -> {length: digests}: token prefixes restored
        # without a CRC check; a cache whose tokens extend one is not stored.
        self._unchecked: dict[tuple, dict[int, set]] = {}
        self.block = block
        self.max_pending_bytes = max_pending_bytes
        self.counters = self.store.counters
        self._spaces = self.store.spaces
        self._identify = identify
        self._extra_classes = extra_classes or (lambda: ())
        self._writer = writer.Writer(
            self.store.lock,
            idle=self._rescan,
            interval=RESCAN_INTERVAL,
            write_rate=write_rate,
            warn=self.store.warn,
        )

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def max_bytes(self) -> int:
        return self.store.max_bytes

    @property
    def settings(self) -> dict:
        return self.store.settings

    # ------------------------------------------------------------- spaces

    def prepare(self, model_key) -> None:
        """Identify and scan ``model_key``'s directory on the writer thread."""
        self._writer.submit(self._space, model_key)

    def _space(self, model_key) -> Space | None:
        return scan.space_for(self.store, model_key, self._identify, self.block)

    def _rescan(self) -> None:
        for space in self.store.live_spaces():
            scan.scan(self.store, space)

    # -------------------------------------------------------------- fetch

    def fetch(self, model_key, tokens: Sequence[int], at_least: int = 0) -> tuple[list, int] | None:
        """``(cache, n)``: the first ``n`` tokens of ``tokens`` restored, or None.

        Only a restore of more than ``at_least`` tokens is attempted.
        """
        try:
            return self._fetch(model_key, tokens, at_least)
        except Exception as e:  # a bug or an odd state must not reach the server
            self.store.warn("fetch", f"restore failed: {e!r}")
            return None

    def _fetch(self, model_key, tokens, at_least):
        if len(tokens) - 1 <= at_least:
            return None
        space = self._space(model_key)
        if space is None:
            return None
        scan.refresh(self.store, space)
        self.store.count(lookups=1)
        for _ in range(3):  # a vanished or corrupt file: try the next best entry
            with self.store.lock:  # pending entries are in the index too
                match = space.index.best(tokens, at_least)
            if match is None:
                return None
            t0 = time.perf_counter()
            got = restore.restore(
                self.store,
                space,
                match.entry,
                verify=self.verify,
                extra_classes=self._extra_classes,
            )
            if got is None:
                continue
            cache, checked = got
            extra = len(match.entry.tokens) - match.length
            if extra and trim_prompt_cache(cache, extra) != extra:
                self.store.warn("trim", "a stored entry could not be trimmed; skipped")
                return None
            if not checked:
                self._mark_unchecked(space, tokens[: match.length])
            self._record_hit(space, match, time.perf_counter() - t0)
            return cache, match.length
        return None

    def _record_hit(self, space, match, dt):
        with self.store.lock:
            c = self.counters
            c["hits"] += 1
            c["restored_tokens"] += match.length
            c["restore_s"] += dt
            c["last_restore_s"] = dt
            slot = bisect.bisect_left(RESTORE_BUCKETS, dt)
            if slot < len(RESTORE_BUCKETS):
                c["restore_buckets"][slot] += 1
            match.entry.recency = time.time()
        if on_disk(match.entry) and self.writable:
            self._writer.submit(writer.touch, self.store, space, match.entry)
        log.info("ssd-cache: restored %d tokens from disk in %.3f s", match.length, dt)

    def _mark_unchecked(self, space, prefix):
        marks = self._unchecked.setdefault((space.fingerprint, space.namespace), {})
        marks.setdefault(len(prefix), set()).add(_digest(prefix))

    def _extends_unchecked(self, space, tokens) -> bool:
        """Whether ``tokens`` start with a prefix restored without a CRC check."""
        marks = self._unchecked.get((space.fingerprint, space.namespace), {})
        return any(n <= len(tokens) and _digest(tokens[:n]) in d for n, d in marks.items())

    # ---------------------------------------------------------------- put

    def put(
        self,
        model_key,
        tokens: Sequence[int],
        prompt_cache: list,
        cache_type: str = "assistant",
        touch: bool = True,
    ) -> None:
        """Hand an inserted prompt cache to the writer (generation thread).

        Only slices, evaluation and zero-copy numpy views happen here; the
        bytes go to disk on the writer thread. Never raises.
        """
        try:
            self._put(model_key, tokens, prompt_cache, cache_type, touch)
        except Exception as e:
            self.store.warn("put", f"cannot store a prompt cache: {e!r}")

    def _put(self, model_key, tokens, prompt_cache, cache_type, touch):
        if self._writer.closed or not self.writable or not len(tokens):
            return
        space = self._space(model_key)
        if space is None:
            return
        tokens = np.asarray(tokens, dtype=np.int64)
        if self._extends_unchecked(space, tokens):
            # Built on KV data nobody checked: storing it would sign that data.
            log.debug("ssd-cache: not stored: extends an unverified restore")
            self.store.count(skipped=1)
            return
        if self._known(space, entry_name(space.namespace, tokens), touch):
            return  # e.g. an eviction of an entry written at insert
        snap, tokens = self._snapshot(space, tokens, prompt_cache)
        if snap is None or len(tokens) == 0:
            return
        name = entry_name(space.namespace, tokens)
        if self._known(space, name, touch):
            return
        entry = self._admit(space, name, tokens, snap, cache_type)
        if entry is not None:
            self._writer.submit(writer.write_entry, self.store, space, entry, self._writer.pacer)

    def _snapshot(self, space, tokens, prompt_cache):
        """``(snapshot, the tokens its KV holds)``; ``(None, tokens)``: not stored."""
        ref = scan.reference(self.store, space)
        if ref is None or len(prompt_cache) < len(ref):
            # An entry that no restore could check is not worth writing.
            why = "ssd-cache: not stored: %d caches, the model makes %s"
            log.debug(why, len(prompt_cache), None if ref is None else len(ref))
            self.store.count(skipped=1)
            return None, tokens
        try:
            # Caches after the model's were added by a plugin (a drafter's
            # state): kept when their plugin registered their class.
            snap = fileformat.snapshot(prompt_cache, len(ref), tuple(self._extra_classes()))
        except fileformat.Unsupported as e:
            log.debug("ssd-cache: not stored: %s", e)
            self.store.count(skipped=1)
            return None, tokens
        if snap.n_tokens is None:
            return snap, tokens
        if snap.n_tokens > len(tokens):
            log.debug("ssd-cache: not stored: cache longer than its tokens")
            self.store.count(skipped=1)
            return None, tokens
        return snap, tokens[: snap.n_tokens]  # what the KV actually holds

    def _admit(self, space, name, tokens, snap, cache_type):
        """Index a new entry as pending, or say why not: the cap, a writer behind."""
        with self.store.lock:
            if name in space.index.entries:
                return None
            problem = None
            if snap.nbytes > self.max_bytes:
                problem = f"{snap.nbytes} bytes exceed the disk cap"
            elif self.store.pending_bytes + snap.nbytes > self.max_pending_bytes:
                problem = "the writer is behind"
            if problem is None:
                extra = {"snapshot": snap, "cache_type": cache_type}
                entry = Entry(name, tokens, snap.trimmable, snap.nbytes, time.time(), extra)
                space.index.add(entry)  # found by fetch before it reaches disk
                space.pending += 1
                self.store.pending_bytes += snap.nbytes
                return entry
            self.counters["skipped"] += 1
        self.store.warn("not stored", f"a prompt cache was not stored: {problem}")
        return None

    def _known(self, space, name, touch):
        """Whether ``name`` is stored or pending; a known entry's use is recorded."""
        with self.store.lock:
            entry = space.index.entries.get(name)
            if entry is None:
                return False
            if touch:
                entry.recency = time.time()
        if touch and on_disk(entry):
            self._writer.submit(writer.touch, self.store, space, entry)
        return True

    # -------------------------------------------------------------- admin

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every handed-over write is on disk. True if it is."""
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the writer; later puts are dropped."""
        return self._writer.close(timeout)

    def stats(self) -> dict:
        """The counters, and the entries and bytes on disk and pending."""
        with self.store.lock:
            stored = [e for _, e in self.store.stored()]
            out = dict(self.counters)
            out["restore_buckets"] = list(out["restore_buckets"])
            out["entries"] = len(stored)
            out["bytes"] = sum(e.nbytes for e in stored)
            out["pending"] = sum(s.pending for s in self.store.live_spaces())
            out["pending_bytes"] = self.store.pending_bytes
        out["writable"] = self.writable
        return out


def _digest(tokens) -> bytes:
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()
