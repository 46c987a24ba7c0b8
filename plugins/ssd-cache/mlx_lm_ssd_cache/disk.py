"""The disk tier: entry files per model fingerprint, an index, a writer thread.

Threads: ``put``, ``fetch`` and ``prepare`` run on the server's generation
thread; files are written, touched, superseded, evicted and rescanned by one
writer thread. The index and the counters are shared under ``_lock``, which is
never held during file I/O. Nothing here raises into the server: every I/O
problem becomes a miss or "not stored", with one warning per kind of problem.
"""

import atexit
import errno
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from . import fileformat, identity, layout, safefs
from .index import Entry, PrefixIndex

log = logging.getLogger("mlx_lm_ssd_cache")

TMP_SUFFIX = ".tmp"
TMP_MAX_AGE = 3600.0  # a .tmp older than this is reaped even if its writer lives
REJECTED_MAX_AGE = 86400.0  # entries set aside stay a day for inspection
RESCAN_INTERVAL = 30.0  # pick up entries other servers wrote into our directory
# Writes are spread at this rate (bytes/s) unless a flush waits for them:
# a burst of copying competes with decode for memory bandwidth and CPU.
WRITE_RATE = 256 << 20
HOST = socket.gethostname()
INFO = "fingerprint.json"


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


def entry_name(namespace, tokens):
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.sha256(namespace.encode() + b"\0" + data).hexdigest()[:32] + fileformat.SUFFIX


def _kind(e):
    """A short kind for an OSError, so that each kind is warned about once."""
    return {
        errno.ENOSPC: "disk full",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOENT: "directory vanished",
    }.get(e.errno, f"I/O error ({errno.errorcode.get(e.errno, e.errno)})")


class DiskTier:
    def __init__(
        self,
        directory,
        max_bytes,
        *,
        verify=False,
        settings=None,
        block=32,
        max_pending_bytes=4 << 30,
        write_rate=WRITE_RATE,
        identify=identity.identify,
        live_models=None,
        extra_classes=None,
    ):
        self.root = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self.verify = verify
        self.settings = dict(settings or {})
        self.block = block
        self.max_pending_bytes = max_pending_bytes
        self.write_rate = write_rate
        self._flushing = 0  # flushes waiting: write at full speed
        self._identify = identify
        # model key -> [model, draft model] as loaded (None: not known here);
        # () -> plugin cache classes that may ride after the model's caches
        self._live_models = live_models or (lambda key: None)
        self._extra_classes = extra_classes or (lambda: ())
        self._spaces = {}  # model key -> Space, or None when it has no disk tier
        self._space_lock = threading.Lock()  # one identification + scan at a time
        # Held by a scan and around each rename or removal, so that a scan
        # never misses a file that the writer is about to index.
        self._dir_lock = threading.RLock()
        # Index, pending writes, counters. Re-entrant: a SIGTERM flush may run
        # on a thread that was interrupted inside the tier (Python API use).
        self._lock = threading.RLock()
        self._jobs = deque()
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._pending_bytes = 0
        self._closed = False
        self._writer = None
        self._warned = set()
        self.counters = dict(
            lookups=0, hits=0, restored_tokens=0, restore_s=0.0, last_restore_s=0.0,
            writes=0, written_bytes=0, write_s=0.0, skipped=0, failures=0,
            evicted=0, superseded=0, removed_corrupt=0,
        )
        _live.add(self)
        _install_exit_flush()

    # ------------------------------------------------------------ helpers

    def _warn(self, kind, message):
        if kind in self._warned:
            log.debug("ssd-cache: %s", message)
        else:
            self._warned.add(kind)
            log.warning("ssd-cache: %s (further ones are logged at debug level)", message)

    def _count(self, **deltas):
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    # ------------------------------------------------------------- spaces

    def prepare(self, model_key):
        """Identify and scan ``model_key``'s directory on the writer thread."""
        self._submit(("prepare", model_key))

    def _space(self, model_key):
        try:
            return self._spaces[model_key]
        except KeyError:
            pass
        except TypeError:  # an unhashable key: not the server's
            return None
        with self._space_lock:
            if model_key in self._spaces:
                return self._spaces[model_key]
            space = None
            try:
                fp, ns, info = self._identify(model_key, self.settings)
                path = self.root / fp / ns
                space = Space(fp, ns, path, info, PrefixIndex(self.block), model_key)
                for other in self._spaces.values():  # keys that name the same files
                    if other is not None and other.path == path:
                        space = other
                        break
                else:
                    self._scan(space)
                log.info(
                    "ssd-cache: %s -> %s (%d entries on disk)",
                    info.get("model"), path, len(space.index),
                )
            except identity.Unidentifiable as e:
                self._warn(f"unidentifiable:{model_key!r}", f"no disk tier for {e}")
            except safefs.NotACache as e:
                self._warn("not a cache", f"no disk tier: {e}")
                space = None
            except Exception as e:  # identification reads user files: never fatal
                self._warn("identify", f"no disk tier for {model_key!r}: {e!r}")
                space = None
            self._spaces[model_key] = space
            return space

    def _scan(self, space):
        with self._dir_lock:
            self._scan_locked(space)

    def _refresh(self, space):
        """Rescan when the directory changed (another server wrote or removed)."""
        try:
            st = os.stat(space.path)
        except OSError:
            return
        if (st.st_mtime_ns, st.st_size) != space.seen:
            self._scan(space)

    def _scan_locked(self, space):
        """Header-only scan of one directory: index good entries, set aside bad ones."""
        try:
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                st = os.fstat(fd)
                space.seen = (st.st_mtime_ns, st.st_size)
                found = self._scan_fd(space, fd)
        except FileNotFoundError:
            return
        except OSError as e:  # a link where a directory should be is refused here too
            self._warn("list: " + _kind(e), f"cannot list {space.path}: {e}")
            return
        with self._lock:  # entries another process removed
            for name, e in list(space.index.entries.items()):
                if name not in found and "snapshot" not in e.extra:
                    space.index.remove(name)

    def _scan_fd(self, space, fd):
        found = set()
        ref = self._reference(space)
        for name, st in safefs.files(fd):
            if safefs.TEMP.fullmatch(name):
                self._maybe_reap(fd, name, st)
            elif safefs.REJECTED.fullmatch(name):
                if time.time() - st.st_mtime > REJECTED_MAX_AGE:
                    self._unlink(space, fd, name)
            elif name in space.index.entries:
                found.add(name)
            else:
                entry = self._read_entry(space, fd, name, ref)
                if entry is not None:
                    found.add(name)
                    with self._lock:
                        space.index.add(entry)
        return found

    def _read_entry(self, space, fd, name, ref):
        try:
            header = fileformat.read_header(name, dir_fd=fd)
            self._check_header(space, header, name, ref)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                self._warn("read: " + _kind(e), f"cannot read {space.path / name}: {e}")
            return None
        except Exception as e:  # Corrupt, or anything else a crafted file provokes
            self._set_aside(space, fd, name, e)
            return None
        return Entry(name, header.tokens, header.trimmable, header.size, header.mtime)

    def _check_header(self, space, header, name, ref):
        meta = header.meta
        if meta.get("fingerprint") != space.fingerprint or meta.get("namespace") != space.namespace:
            raise fileformat.Corrupt("entry of another fingerprint or namespace")
        if entry_name(space.namespace, header.tokens) != name:
            raise fileformat.Corrupt("file name does not match its tokens")
        if header.size > self.max_bytes:
            raise fileformat.Corrupt(f"{header.size} bytes exceed the disk cap")
        if ref is None:
            raise fileformat.Corrupt("the model's cache layout is unknown")
        layout.validate(header, ref)

    def _reference(self, space):
        """The caches the model makes: from the loaded model when the server has
        told us of it (exact dtypes), else from its config (random lazy weights)."""
        live = self._live_models(space.model_key)
        if space.ref is not None and (space.ref.exact_dtype or not live):
            return space.ref
        try:
            if live:
                space.ref = layout.reference(live, self.settings, exact_dtype=True)
            else:
                models = identity.lazy_models(space.model_key)
                space.ref = layout.reference(models, self.settings, exact_dtype=False)
        except Exception as e:  # an architecture that cannot be built from its config
            self._warn("layout", f"cache layout of {space.info.get('model')} unknown: {e!r}")
        return space.ref

    def _set_aside(self, space, fd, name, why):
        """Rename a bad entry to ``<name>.rejected``: never restored, kept a day."""
        self._warn("corrupt", f"set aside entry {space.path / name}: {why}")
        self._count(removed_corrupt=1)
        try:
            if safefs.ENTRY.fullmatch(name):
                safefs.rename(fd, name, name + ".rejected")
        except OSError:
            pass

    def _unlink(self, space, fd, name):
        try:
            return safefs.unlink(fd, name)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._warn("remove: " + _kind(e), f"cannot remove {space.path / name}: {e}")
            return False

    def _maybe_reap(self, fd, name, st):
        """Remove a temp file whose writer died (same host) or that is stale."""
        parts = name.split(".")
        try:
            host, pid = parts[-4], int(parts[-3])
        except (IndexError, ValueError):
            host, pid = None, None
        age = time.time() - st.st_mtime
        # This process may hold another tier on the same directory (tests):
        # its own temp files are only reaped once stale.
        alive = host == HOST and pid is not None and (pid == os.getpid() or _pid_alive(pid))
        if (not alive and host == HOST) or age > TMP_MAX_AGE:
            try:
                if safefs.unlink(fd, name):
                    log.info("ssd-cache: reaped unfinished write %s", name)
            except OSError:
                pass

    # -------------------------------------------------------------- fetch

    def fetch(self, model_key, tokens, at_least=0):
        """``(cache, n)``: the first ``n`` tokens of ``tokens`` restored, or None.

        Only a restore of more than ``at_least`` tokens is attempted.
        """
        try:
            return self._fetch(model_key, tokens, at_least)
        except Exception as e:  # a bug or an odd state must not reach the server
            self._warn("fetch", f"restore failed: {e!r}")
            return None

    def _fetch(self, model_key, tokens, at_least):
        if len(tokens) - 1 <= at_least:
            return None
        space = self._space(model_key)
        if space is None:
            return None
        self._refresh(space)
        self._count(lookups=1)
        for _ in range(3):  # a vanished or corrupt file: try the next best entry
            with self._lock:  # pending entries are in the index too
                match = space.index.best(tokens, at_least)
            if match is None:
                return None
            t0 = time.perf_counter()
            cache = self._restore(space, match.entry)
            if cache is None:
                continue
            extra = len(match.entry.tokens) - match.length
            if extra and trim_prompt_cache(cache, extra) != extra:
                self._warn("trim", "a stored entry could not be trimmed; skipped")
                return None
            dt = time.perf_counter() - t0
            with self._lock:
                c = self.counters
                c["hits"] += 1
                c["restored_tokens"] += match.length
                c["restore_s"] += dt
                c["last_restore_s"] = dt
                match.entry.recency = time.time()
            if "snapshot" not in match.entry.extra:
                self._submit(("touch", space, match.entry))
            log.info(
                "ssd-cache: restored %d tokens from disk in %.3f s", match.length, dt
            )
            return cache, match.length
        return None

    def _restore(self, space, entry):
        snap = entry.extra.get("snapshot")
        if snap is not None:  # still on its way to disk
            return self._with_extras(*fileformat.from_snapshot(snap))
        try:
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                return self._restore_file(space, entry, fd)
        except OSError as e:
            self._forget(space, entry.name)  # until a rescan finds it readable
            self._warn("read: " + _kind(e), f"cannot open {space.path}: {e}")
        return None

    def _restore_file(self, space, entry, fd):
        try:
            header = fileformat.read_header(entry.name, dir_fd=fd)
            self._check_header(space, header, entry.name, self._reference(space))
            if not np.array_equal(header.tokens, entry.tokens):
                raise fileformat.Corrupt("tokens differ from the index")
            return self._with_extras(*fileformat.load(header, verify=self.verify, dir_fd=fd))
        except FileNotFoundError:
            self._forget(space, entry.name)
            self._warn("vanished", f"entry {space.path / entry.name} vanished (removed by another process?)")
        except OSError as e:
            self._forget(space, entry.name)
            self._warn("read: " + _kind(e), f"cannot read {space.path / entry.name}: {e}")
        except Exception as e:  # Corrupt, or whatever else a crafted file provokes
            self._forget(space, entry.name)
            self._set_aside(space, fd, entry.name, e)
        return None

    def _with_extras(self, caches, extras):
        """The model's caches plus the stored plugin caches this process knows.

        A plugin cache (a drafter's state) is rebuilt only by its own class,
        registered by its plugin; unknown ones are dropped, and the plugin
        that needs them makes fresh ones.
        """
        known = {c.__name__: c for c in self._extra_classes()}
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

    def _forget(self, space, name):
        with self._lock:
            space.index.remove(name)

    # ---------------------------------------------------------------- put

    def put(self, model_key, tokens, prompt_cache, cache_type="assistant", touch=True):
        """Hand an inserted prompt cache to the writer (generation thread).

        Only slices, evaluation and zero-copy numpy views happen here; the
        bytes go to disk on the writer thread. Never raises.
        """
        try:
            self._put(model_key, tokens, prompt_cache, cache_type, touch)
        except Exception as e:
            self._warn("put", f"cannot store a prompt cache: {e!r}")

    def _put(self, model_key, tokens, prompt_cache, cache_type, touch):
        if self._closed or not len(tokens):
            return
        space = self._space(model_key)
        if space is None:
            return
        tokens = np.asarray(tokens, dtype=np.int64)
        if self._known(space, entry_name(space.namespace, tokens), touch):
            return  # e.g. an eviction of an entry written at insert
        ref = self._reference(space)
        if ref is None or len(prompt_cache) < len(ref):
            # An entry that no restore could check is not worth writing.
            log.debug("ssd-cache: not stored: %d caches, the model makes %s",
                      len(prompt_cache), None if ref is None else len(ref))
            self._count(skipped=1)
            return
        try:
            # Caches after the model's were added by a plugin (a drafter's
            # state): kept when their plugin registered their class.
            snap = fileformat.snapshot(prompt_cache, len(ref), tuple(self._extra_classes()))
        except fileformat.Unsupported as e:
            log.debug("ssd-cache: not stored: %s", e)
            self._count(skipped=1)
            return
        if snap.n_tokens is not None:
            if snap.n_tokens > len(tokens):
                log.debug("ssd-cache: not stored: cache longer than its tokens")
                self._count(skipped=1)
                return
            tokens = tokens[: snap.n_tokens]  # what the KV actually holds
        if len(tokens) == 0:
            return
        name = entry_name(space.namespace, tokens)
        if self._known(space, name, touch):
            return
        with self._lock:
            stored = space.index.entries.get(name)
            if stored is None:
                problem = None
                if snap.nbytes > self.max_bytes:
                    problem = f"{snap.nbytes} bytes exceed the disk cap"
                elif self._pending_bytes + snap.nbytes > self.max_pending_bytes:
                    problem = "the writer is behind"
                if problem is None:
                    entry = Entry(name, tokens, snap.trimmable, snap.nbytes, time.time(),
                                  {"snapshot": snap, "cache_type": cache_type})
                    space.index.add(entry)  # found by fetch before it reaches disk
                    space.pending += 1
                    self._pending_bytes += snap.nbytes
                else:
                    self.counters["skipped"] += 1
        if stored is not None:
            return
        if problem is not None:
            self._warn("not stored", f"a prompt cache was not stored: {problem}")
        else:
            self._submit(("write", space, entry))

    def _known(self, space, name, touch):
        """Whether ``name`` is stored or pending; a known entry's use is recorded."""
        with self._lock:
            entry = space.index.entries.get(name)
            if entry is None:
                return False
            if touch:
                entry.recency = time.time()
        if touch and "snapshot" not in entry.extra:
            self._submit(("touch", space, entry))
        return True

    # ------------------------------------------------------------- writer

    def _submit(self, job):
        with self._wake:
            if self._closed:
                return
            self._jobs.append(job)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._run, name="ssd-cache-writer", daemon=True
                )
                self._writer.start()
            self._wake.notify()

    def _run(self):
        _lower_priority()
        next_rescan = time.monotonic() + RESCAN_INTERVAL
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    timeout = next_rescan - time.monotonic()
                    if timeout <= 0:
                        break
                    self._wake.wait(timeout)
                if self._closed and not self._jobs:
                    self._busy = False
                    self._wake.notify_all()
                    return
                job = self._jobs.popleft() if self._jobs else ("rescan",)
                self._busy = True
            try:
                if job[0] == "rescan":
                    next_rescan = time.monotonic() + RESCAN_INTERVAL
                getattr(self, "_job_" + job[0])(*job[1:])
            except Exception as e:  # the writer must survive anything
                self._warn("writer", f"writer job {job[0]} failed: {e!r}")
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _job_prepare(self, model_key):
        self._space(model_key)

    def _job_rescan(self):
        for space in {s for s in list(self._spaces.values()) if s is not None}:
            self._scan(space)

    def _job_touch(self, space, entry):
        try:
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                os.utime(entry.name, (entry.recency, entry.recency), dir_fd=fd,
                         follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass

    def _job_write(self, space, entry):
        snap = entry.extra["snapshot"]
        t0 = time.perf_counter()
        done = self._write_tmp(space, entry, snap)
        # The rename and the index update happen together under the directory
        # lock: a scan never sees the new file while the index has it pending.
        with self._dir_lock:
            if done is not None:
                done = self._rename(space, entry, done)
            with self._lock:
                space.pending -= 1
                self._pending_bytes -= snap.nbytes
                entry.extra = {}
                if done is None and space.index.entries.get(entry.name) is entry:
                    space.index.remove(entry.name)
        if done is None:
            return
        entry.nbytes = done
        dt = time.perf_counter() - t0
        self._count(writes=1, written_bytes=done, write_s=dt)
        log.debug("ssd-cache: stored %d tokens (%d bytes) in %.3f s", len(entry.tokens), done, dt)
        self._supersede(space, entry)
        self._enforce_cap(keep=entry)

    def _write_tmp(self, space, entry, snap):
        """Write the entry to a temp file: ``(tmp name, size)``, or None."""
        self._make_room(snap.nbytes)
        tmp = f".{entry.name}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        meta = {
            "tokens": fileformat.tokens_json(entry.tokens),
            "n_tokens": str(len(entry.tokens)),
            "cache_type": entry.extra.get("cache_type", "assistant"),
            "created": f"{time.time():.3f}",
            "fingerprint": space.fingerprint,
            "namespace": space.namespace,
            "model": str(space.info.get("model", "")),
        }
        try:
            safefs.make_space(self.root, space.fingerprint, space.namespace)
            self._write_info(space)
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                return tmp, fileformat.write(tmp, snap, meta, pace=self._pacer(), dir_fd=fd)
        except Exception as e:  # OSError, or a bug: the entry is just not stored
            self._write_failed(space, tmp, e)
            return None

    def _pacer(self):
        """Sleep between pieces so that a write runs at ``write_rate``."""
        if not self.write_rate:
            return None
        t0, done = time.monotonic(), 0

        def pace(n):
            nonlocal done
            done += n
            ahead = done / self.write_rate - (time.monotonic() - t0)
            if ahead > 0.002 and not self._flushing and not self._closed:
                time.sleep(min(ahead, 0.1))

        return pace

    def _rename(self, space, entry, done):
        tmp, size = done
        try:
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                safefs.rename(fd, tmp, entry.name)
                _fsync_fd(fd)
        except OSError as e:
            self._write_failed(space, tmp, e)
            return None
        return size

    def _write_failed(self, space, tmp, e):
        kind = _kind(e) if isinstance(e, OSError) else repr(e)
        self._warn("write: " + kind, f"prompt cache not stored in {space.path}: {kind}: {e}")
        self._count(failures=1)
        try:
            with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                safefs.unlink(fd, tmp)
        except OSError:
            pass

    def _write_info(self, space):
        """A readable note of what a fingerprint stands for (for ``ssd-cache stats``)."""
        tmp = f".{INFO}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with safefs.open_dir(self.root) as rfd, safefs.open_dir(space.fingerprint, rfd) as fd:
                if INFO in os.listdir(fd):
                    return
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                              0o644, dir_fd=fd)
                with os.fdopen(out, "w") as f:
                    f.write(json.dumps(space.info, indent=1, sort_keys=True))
                os.replace(tmp, INFO, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            pass

    def _supersede(self, space, entry):
        """A trimmable entry makes its stored prefixes redundant: remove them."""
        if not entry.trimmable:
            return
        with self._lock:
            older = [
                e for e in space.index.prefixes_of(entry.tokens)
                if e is not entry and "snapshot" not in e.extra
            ]
        for e in older:
            if self._delete(space, e):
                self._count(superseded=1)

    def _delete(self, space, entry):
        with self._dir_lock:
            with self._lock:
                if space.index.entries.get(entry.name) is not entry:
                    return False
                space.index.remove(entry.name)
            try:
                with safefs.open_space(self.root, space.fingerprint, space.namespace) as fd:
                    self._unlink(space, fd, entry.name)
            except OSError as e:
                self._warn("remove: " + _kind(e), f"cannot remove {space.path / entry.name}: {e}")
        return True

    def _stored(self):
        with self._lock:
            spaces = {s for s in self._spaces.values() if s is not None}
            return [
                (s, e) for s in spaces for e in s.index.entries.values()
                if "snapshot" not in e.extra  # pending: not on disk yet
            ]

    def _make_room(self, incoming):
        self._enforce_cap(extra=incoming)

    def _enforce_cap(self, extra=0, keep=None):
        """Remove least recently used entries until the cap holds."""
        stored = self._stored()
        total = sum(e.nbytes for _, e in stored) + extra
        for space, e in sorted(stored, key=lambda se: se[1].recency):
            if total <= self.max_bytes:
                break
            if e is keep:
                continue
            if self._delete(space, e):
                total -= e.nbytes
                self._count(evicted=1)

    # -------------------------------------------------------------- admin

    def flush(self, timeout=None):
        """Wait until every handed-over write is on disk. True if it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            try:
                while self._jobs or self._busy:
                    if self._writer is None or not self._writer.is_alive():
                        return not self._jobs
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(left)
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout=None):
        done = self.flush(timeout)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        _live.discard(self)
        return done

    def stats(self):
        with self._lock:
            spaces = {s for s in self._spaces.values() if s is not None}
            entries = [
                e for s in spaces for e in s.index.entries.values()
                if "snapshot" not in e.extra
            ]
            out = dict(self.counters)
            out["entries"] = len(entries)
            out["bytes"] = sum(e.nbytes for e in entries)
            out["pending"] = sum(s.pending for s in spaces)
            out["pending_bytes"] = self._pending_bytes
        return out


WRITER_NICE = 10


def _lower_priority():
    """Let the generation thread win the CPU over the writer (Linux: per thread).

    On Linux ``setpriority`` on a thread id changes that thread only; decode
    then keeps its pace while the writer hashes and copies bytes.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except (OSError, AttributeError):
        pass


def _fsync_fd(fd):
    try:
        os.fsync(fd)
    except OSError:
        pass


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------- flush at exit and SIGTERM

_live = weakref.WeakSet()
_exit_installed = False
FLUSH_TIMEOUT = 120.0


def flush_all(timeout=FLUSH_TIMEOUT):
    for tier in list(_live):
        tier.flush(timeout)


def _install_exit_flush():
    """Flush pending writes at interpreter exit and on SIGTERM (main thread only).

    Ctrl-C ends ``mlx_lm.server`` through KeyboardInterrupt and a normal exit,
    so atexit covers SIGINT; SIGTERM would kill the process without it.
    """
    global _exit_installed
    if _exit_installed:
        return
    _exit_installed = True
    atexit.register(flush_all)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        flush_all()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:
        pass
