"""The writer thread, and the jobs that write: entry files, touches, the fingerprint note.

``Writer`` runs submitted jobs one at a time on a daemon thread at a lower
priority than generation, and runs an idle job (a rescan) when nothing was
submitted for a while. ``write_entry`` is the job that puts a pending entry
on disk: a temp file written at a paced rate, fsynced, renamed into place.
Pending writes are flushed at interpreter exit and on SIGTERM.
"""

import atexit
import json
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from mlx_lm_ext import safefs

from . import eviction, fileformat
from .index import Entry
from .store import Space, Store, error_kind, log

INFO = "fingerprint.json"
# Writes are spread at this rate (bytes/s) unless a flush waits for them:
# a burst of copying competes with decode for memory bandwidth and CPU.
WRITE_RATE = 256 << 20
WRITER_NICE = 10
FLUSH_TIMEOUT = 120.0

Pace = Callable[[int], None]


class Writer:
    """One daemon thread that runs jobs in the order they were submitted.

    It shares the tier's lock (``lock``), so that a flush sees pending entries
    and queued jobs consistently. The thread starts with the first job.
    """

    def __init__(
        self,
        lock: threading.RLock,
        *,
        idle: Callable[[], None],
        interval: float,
        write_rate: int,
        warn: Callable[[str, str], None],
    ):
        self.write_rate = write_rate
        self.closed = False
        self._idle, self._interval, self._warn = idle, interval, warn
        self._jobs = deque()
        self._wake = threading.Condition(lock)
        self._busy = False
        self._flushing = 0  # flushes waiting: write at full speed
        self._thread = None
        _live.add(self)
        _install_exit_flush()

    def submit(self, job: Callable, *args) -> None:
        """Run ``job(*args)`` on the writer thread; dropped once closed."""
        with self._wake:
            if self.closed:
                return
            self._jobs.append((job, args))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ssd-cache-writer", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self):
        _lower_priority()
        next_idle = time.monotonic() + self._interval
        while True:
            with self._wake:
                while not self._jobs and not self.closed:
                    timeout = next_idle - time.monotonic()
                    if timeout <= 0:
                        break
                    self._wake.wait(timeout)
                if self.closed and not self._jobs:
                    self._busy = False
                    self._wake.notify_all()
                    return
                job, args = self._jobs.popleft() if self._jobs else (None, ())
                self._busy = True
            if job is None:  # nothing submitted for a while
                job, next_idle = self._idle, time.monotonic() + self._interval
            try:
                job(*args)
            except Exception as e:  # the writer must survive anything
                self._warn("writer", f"writer job {job.__name__} failed: {e!r}")
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def pacer(self) -> Pace | None:
        """Sleep between pieces so that a write runs at ``write_rate``.

        A flush or close waiting for the writer lifts the pace.
        """
        if not self.write_rate:
            return None
        t0, done = time.monotonic(), 0

        def pace(n):
            nonlocal done
            done += n
            ahead = done / self.write_rate - (time.monotonic() - t0)
            if ahead > 0.002 and not self._flushing and not self.closed:
                time.sleep(min(ahead, 0.1))

        return pace

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run. True if they have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            try:
                while self._jobs or self._busy:
                    if self._thread is None or not self._thread.is_alive():
                        return not self._jobs
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(left)
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the thread; later jobs are dropped."""
        done = self.flush(timeout)
        with self._wake:
            self.closed = True
            self._wake.notify_all()
        _live.discard(self)
        return done


# ------------------------------------------------------------ writer jobs


def write_entry(store: Store, space: Space, entry: Entry, pacer: Callable[[], Pace | None]) -> None:
    """Put a pending entry on disk, then supersede its prefixes and hold the cap."""
    snap = entry.extra["snapshot"]
    t0 = time.perf_counter()
    eviction.make_room(store, snap.nbytes)
    done = _write_temp(store, space, entry, snap, pacer)
    # The rename and the index update happen together under the directory
    # lock: a scan never sees the new file while the index has it pending.
    with store.dir_lock:
        if done is not None:
            done = _rename(store, space, entry, done)
        with store.lock:
            space.pending -= 1
            store.pending_bytes -= snap.nbytes
            entry.extra = {}
            if done is None and space.index.entries.get(entry.name) is entry:
                space.index.remove(entry.name)
    if done is None:
        return
    entry.nbytes = done
    dt = time.perf_counter() - t0
    store.count(writes=1, written_bytes=done, write_s=dt)
    log.debug("ssd-cache: stored %d tokens (%d bytes) in %.3f s", len(entry.tokens), done, dt)
    eviction.supersede(store, space, entry)
    eviction.enforce_cap(store, keep=entry)


def _write_temp(store, space, entry, snap, pacer):
    """Write the entry to a temp file: ``(tmp name, size)``, or None."""
    tmp = safefs.temp_name(entry.name)  # locked while written (safefs.create_temp)
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
        safefs.make_space(store.root, space.fingerprint, space.namespace)
        write_info(store, space)
        with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
            # Through the module, not the name: tests and the fault-injecting
            # server replace ``fileformat.write``.
            return tmp, fileformat.write(tmp, snap, meta, pace=pacer(), dir_fd=fd)
    except Exception as e:  # OSError, or a bug: the entry is just not stored
        _write_failed(store, space, tmp, e)
        return None


def _rename(store, space, entry, done):
    tmp, size = done
    try:
        with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
            safefs.rename(fd, tmp, entry.name)
            _fsync_fd(fd)
    except OSError as e:
        _write_failed(store, space, tmp, e)
        return None
    return size


def _write_failed(store, space, tmp, e):
    kind = error_kind(e) if isinstance(e, OSError) else repr(e)
    store.warn("write: " + kind, f"prompt cache not stored in {space.path}: {kind}: {e}")
    store.count(failures=1)
    try:
        with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
            safefs.unlink(fd, tmp)
    except OSError:
        pass


def write_info(store: Store, space: Space) -> None:
    """A readable note of what a fingerprint stands for (for ``ssd-cache stats``)."""
    try:
        with safefs.open_dir(store.root) as rfd, safefs.open_dir(space.fingerprint, rfd) as fd:
            if INFO in os.listdir(fd):
                return
            safefs.write_file(fd, INFO, json.dumps(space.info, indent=1, sort_keys=True).encode())
    except OSError:
        pass


def touch(store: Store, space: Space, entry: Entry) -> None:
    """Record a use in the file's mtime, which the next process reads as recency."""
    try:
        with safefs.open_space(store.root, space.fingerprint, space.namespace) as fd:
            times = (entry.recency, entry.recency)
            os.utime(entry.name, times, dir_fd=fd, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


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


# ------------------------------------------------- flush at exit and SIGTERM

_live = weakref.WeakSet()
_exit_installed = False


def flush_all(timeout: float = FLUSH_TIMEOUT) -> None:
    """Wait for the pending writes of every open tier in this process."""
    for writer in list(_live):
        writer.flush(timeout)


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
