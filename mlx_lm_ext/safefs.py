"""Files on a disk the package does not trust: tagged roots, no symlinks, own names only.

A directory the package keeps files in may be shared with other users or
written by an attacker, so every write and removal here holds to three rules:

* only inside a root the package created and marked with ``CACHEDIR.TAG``
  (the standard cache-directory tag, which backup tools also honour);
* never through a symbolic link: each level is opened with ``O_NOFOLLOW`` and
  every later lookup is relative to that open directory (``dir_fd``), so a
  directory swapped for a link after it was checked is never entered;
* only names the package itself makes, and only regular files.

Two users, each a ``Kind`` (what its tag says, which top-level folders it
makes): ssd-cache (``CACHE``: ``<root>/<16 hex>/<namespace>/<entry>``, the
names below) and spec-decode's suffix corpus (``CORPUS``:
``<root>/<32 hex>/suffix-corpus.npz``).

Temp files (``temp_name``) are created by ``create_temp``, which holds an
advisory lock (``flock``) on the file while it is open. ``reap`` removes only
a temp file nobody holds locked that was untouched for a grace period: the
pid in a temp file's name is never trusted, since a process in another PID
namespace (a container) cannot see the writer's.
"""

import contextlib
import errno
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

try:
    import fcntl
except ImportError:  # no advisory locks: temp files are reaped by age only
    fcntl = None

TAG = "CACHEDIR.TAG"
SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"


@dataclass(frozen=True)
class Kind:
    """What one user keeps under its tagged roots."""

    owner: str  # the package named in the tag
    about: str  # the tag's further comment lines
    folder: "re.Pattern[str]"  # its top-level folders (one per model fingerprint)


CACHE = Kind(
    "mlx-lm-ssd-cache",
    "It marks the directory as the disk tier of mlx_lm.server's prompt cache:\n"
    "`mlx-lm-ext ssd-cache clear` only clears directories that carry it.",
    re.compile(r"[0-9a-f]{16}"),
)
CORPUS = Kind(
    "mlx-lm-spec-decode",
    "It marks the directory as the suffix drafter's corpora (--suffix-corpus-dir),\n"
    "one folder per model fingerprint.",
    re.compile(r"[0-9a-f]{32}"),
)


def tag_text(kind: Kind) -> str:
    lines = [SIGNATURE, f"# This file is a cache directory tag created by {kind.owner}."]
    return "\n".join(lines + [f"# {line}" for line in kind.about.splitlines()]) + "\n"


TAG_TEXT = tag_text(CACHE)

# ssd-cache's names.
FINGERPRINT = CACHE.folder
NAMESPACE = re.compile(r"base|ns-[0-9a-f]{16}")
ENTRY = re.compile(r"[0-9a-f]{32}\.safetensors")
# What the writer makes: `.<entry>.<host>.<pid>.<hex>.tmp` (``temp_name``), and
# the same for the fingerprint note; `<entry>.rejected` is an entry set aside
# on restore.
TEMP = re.compile(r"\.(?:[0-9a-f]{32}\.safetensors|fingerprint\.json)\.[^/]*\.tmp")
REJECTED = re.compile(r"[0-9a-f]{32}\.safetensors\.rejected")
INFO = "fingerprint.json"
_NOTE_TEMP = re.compile(r"\.fingerprint\.json\.[^/]*\.tmp")

# The host in temp file names: a temp of another host (a shared network
# folder) is given longer before it is reaped (``REAP_OTHER_HOST``).
HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
# Unlocked temp files untouched this long are reaped: their writer is gone
# (a writer holds its lock from creation to the rename, bar microseconds).
REAP_GRACE = 2.0
# Other hosts' temp files, and any where the file system cannot lock.
REAP_OTHER_HOST = 3600.0

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotACache(ValueError):
    """A directory that is not (or not safely) a cache directory of the tier."""


def is_own_file(name: str) -> bool:
    """Whether ``name`` is one the tier makes inside a namespace directory."""
    return bool(ENTRY.fullmatch(name) or TEMP.fullmatch(name) or REJECTED.fullmatch(name))


# ------------------------------------------------------------------ roots


def has_tag(root: Union[str, os.PathLike]) -> bool:
    """Whether ``root`` is a real directory (not a link) with the tier's tag."""
    try:
        with open_dir(root) as fd:
            return _read_tag(fd)
    except OSError:
        return False


def _read_tag(fd) -> bool:
    try:
        tfd = os.open(TAG, _FILE_FLAGS, dir_fd=fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(tfd).st_mode):
            return False
        return os.read(tfd, len(SIGNATURE)).decode("ascii", "replace") == SIGNATURE
    finally:
        os.close(tfd)


def looks_like_cache(root: Union[str, os.PathLike], kind: Kind = CACHE) -> bool:
    """Whether every name in ``root`` is one ``kind`` would put there.

    Used to adopt a directory written before the tag existed, and an empty
    one: a folder of anything else (a home directory, a model folder) is not.
    """
    try:
        with open_dir(root) as fd:
            names = os.listdir(fd)
    except OSError:
        return False
    return all(kind.folder.fullmatch(n) or n == TAG or n.startswith(f".{TAG}.") for n in names)


def make_root(root: Union[str, os.PathLike], kind: Kind = CACHE) -> None:
    """Create ``root`` if needed and tag it; refuse a directory that is not ours.

    Raises ``NotACache`` for a link, a non-directory, or an untagged
    directory with content ``kind`` did not make. ``OSError`` for I/O trouble.
    """
    root = os.fspath(root).rstrip("/") or "/"  # "link/" would resolve the link
    os.makedirs(root, exist_ok=True)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        # A link as the root itself is the user's own choice only if they gave
        # the resolved path: refuse, so that nothing is ever entered through one.
        raise NotACache(f"{root} is a symbolic link; give the directory it points to")
    if not stat.S_ISDIR(st.st_mode):
        raise NotACache(f"{root} is not a directory")
    with open_dir(root) as fd:
        if _read_tag(fd):
            return
        if not looks_like_cache(root, kind):
            what = "ssd-cache entries" if kind is CACHE else f"{kind.owner}'s"
            raise NotACache(
                f"{root} holds files that are not {what} and has no {TAG}; "
                "use an empty or new directory"
            )
        tmp = f".{TAG}.{os.getpid()}.tmp"
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            os.write(tfd, tag_text(kind).encode())
        finally:
            os.close(tfd)
        os.replace(tmp, TAG, src_dir_fd=fd, dst_dir_fd=fd)


# -------------------------------------------------------------- directories


@contextlib.contextmanager
def open_dir(path: Union[str, os.PathLike], dir_fd: Optional[int] = None) -> Iterator[int]:
    """An fd of directory ``path`` (relative to ``dir_fd``), never through a link."""
    path = os.fspath(path)
    if len(path) > 1:  # "link/" would resolve the link despite O_NOFOLLOW
        path = path.rstrip("/") or "/"
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_space(root: Union[str, os.PathLike], fingerprint: str, namespace: str) -> Iterator[int]:
    """The fd of ``root/fingerprint/namespace``, each level opened without links."""
    if not FINGERPRINT.fullmatch(fingerprint) or not NAMESPACE.fullmatch(namespace):
        raise NotACache(f"{fingerprint}/{namespace} is not a namespace of the tier")
    with open_dir(root) as rfd, open_dir(fingerprint, rfd) as ffd, open_dir(namespace, ffd) as nfd:
        yield nfd


def make_folder(root: Union[str, os.PathLike], name: str, kind: Kind) -> None:
    """Create the top-level folder ``name`` of ``kind`` below a tagged root, without links."""
    _check_folder(name, kind)
    make_root(root, kind)
    with open_dir(root) as rfd:
        _mkdir_at(name, rfd)


@contextlib.contextmanager
def open_folder(root: Union[str, os.PathLike], name: str, kind: Kind) -> Iterator[int]:
    """The fd of ``root/name``, a top-level folder of ``kind``, each level without links."""
    _check_folder(name, kind)
    with open_dir(root) as rfd, open_dir(name, rfd) as fd:
        yield fd


def _check_folder(name, kind):
    if not kind.folder.fullmatch(name):
        raise NotACache(f"{name} is not a folder name of {kind.owner}")


def make_space(root: Union[str, os.PathLike], fingerprint: str, namespace: str) -> None:
    """Create ``root/fingerprint/namespace`` below a tagged root, without links."""
    make_root(root)
    with open_dir(root) as rfd:
        for name, parent in ((fingerprint, None), (namespace, fingerprint)):
            if parent is None:
                _mkdir_at(name, rfd)
            else:
                with open_dir(parent, rfd) as pfd:
                    _mkdir_at(name, pfd)


def _mkdir_at(name, fd):
    try:
        os.mkdir(name, 0o755, dir_fd=fd)
    except FileExistsError:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise NotACache(f"{name} exists and is not a directory (a link?)") from None


def spaces(root: Union[str, os.PathLike]) -> List[Tuple[str, str]]:
    """``(fingerprint, namespace)`` pairs under a root: real directories only."""
    out = []
    try:
        with open_dir(root) as rfd:
            for fp in sorted(os.listdir(rfd)):
                if not FINGERPRINT.fullmatch(fp) or not _is_dir_at(fp, rfd):
                    continue
                try:
                    with open_dir(fp, rfd) as ffd:
                        out += [
                            (fp, ns)
                            for ns in sorted(os.listdir(ffd))
                            if NAMESPACE.fullmatch(ns) and _is_dir_at(ns, ffd)
                        ]
                except OSError:
                    continue
    except OSError:
        return []
    return out


def _is_dir_at(name, fd) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def files(space_fd: int) -> List[Tuple[str, os.stat_result]]:
    """The tier's own regular files in an open namespace: ``(name, lstat)``."""
    out = []
    for name in sorted(os.listdir(space_fd)):
        if not is_own_file(name):
            continue
        try:
            st = os.stat(name, dir_fd=space_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((name, st))
    return out


# ------------------------------------------------------------------ removal


def unlink(space_fd: int, name: str) -> bool:
    """Remove one of the tier's own regular files from an open namespace.

    A link or anything that is not a regular file of a tier name is left
    alone (False). ``unlink`` itself never follows a link, so a file swapped
    for one between the check and the removal only loses the link.
    """
    if not is_own_file(name):
        return False
    try:
        st = os.stat(name, dir_fd=space_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    os.unlink(name, dir_fd=space_fd)
    return True


def rename(space_fd: int, src: str, dst: str) -> None:
    """Rename within one open namespace (no path is resolved again)."""
    os.replace(src, dst, src_dir_fd=space_fd, dst_dir_fd=space_fd)


def remove_space_if_empty(root: Union[str, os.PathLike], fingerprint: str, namespace: str) -> None:
    """rmdir an emptied namespace, then its fingerprint if only its note is left.

    The note and a leftover temp file of it (a writer killed between write
    and rename) go with the fingerprint; anything else keeps it.
    """
    if not FINGERPRINT.fullmatch(fingerprint) or not NAMESPACE.fullmatch(namespace):
        return
    try:
        with open_dir(root) as rfd, open_dir(fingerprint, rfd) as ffd:
            with contextlib.suppress(OSError):
                os.rmdir(namespace, dir_fd=ffd)
            rest = os.listdir(ffd)
            if not all(n == INFO or _NOTE_TEMP.fullmatch(n) for n in rest):
                return
            for name in rest:
                st = os.stat(name, dir_fd=ffd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return
            for name in rest:
                os.unlink(name, dir_fd=ffd)
            os.rmdir(fingerprint, dir_fd=rfd)
    except OSError:
        pass


# ------------------------------------------------------------------ reading


def open_file(space_fd: int, name: str) -> int:
    """An fd of a regular file in an open namespace: no link, no FIFO or device.

    ``O_NONBLOCK`` keeps a FIFO planted under an entry's name from blocking
    the open; it is refused right after by the ``S_ISREG`` check.
    """
    fd = os.open(name, _FILE_FLAGS, dir_fd=space_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> Optional[str]:
    """A path that reopens exactly the file behind ``fd`` (Linux), else None."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


# ------------------------------------------------------------- temp files


def temp_name(final: str) -> str:
    """A fresh temp file name for ``final``: ``.<final>.<host>.<pid>.<hex>.tmp``.

    The host and pid only tell a reader whose file it is; the lock that
    ``create_temp`` holds is what says a write is still under way.
    """
    return f".{final}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def of_this_host(name: str) -> bool:
    """Whether temp file ``name`` (``temp_name``'s form) was made on this host."""
    rest = name[: -len(".tmp")].rsplit(".", 2)[0] if name.endswith(".tmp") else ""
    return rest.endswith("." + HOST)


def create_temp(name: str, dir_fd: Optional[int] = None, mode: int = 0o644) -> int:
    """Create ``name`` (exclusively, never through a link) for writing: its fd.

    The fd holds an exclusive ``flock`` on the file until it is closed, so
    ``reap`` in any process (any PID namespace) leaves the file alone while it
    is written. The lock is taken blocking: only a reaper checking the new
    file can hold it, for a moment.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
    fd = os.open(name, flags, mode, dir_fd=dir_fd)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: reaped by age only
            pass
    return fd


def write_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``name`` in an open directory with ``data``: a locked temp file,
    fsynced and renamed over it while still locked, so a crash leaves the old
    file or the new one, and no reaper takes the temp file meanwhile."""
    tmp = temp_name(name)
    fd = create_temp(tmp, dir_fd, mode)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)


def reap(
    dir_fd: int, name: str, grace: float = REAP_GRACE, unsure_grace: float = REAP_OTHER_HOST
) -> bool:
    """Remove the temp file ``name`` if its writer is gone; True if removed.

    Gone means: nobody holds the file's lock and it was untouched for
    ``grace`` seconds (``unsure_grace`` for another host's file, or where
    the lock cannot be tested). The pid in the name is not looked at. A link
    or anything but a regular file is left alone.
    """
    try:
        fd = _open_to_lock(name, dir_fd)
    except OSError:
        return False
    try:
        locked = _try_lock(fd)
        if locked is False:
            return False  # a live writer holds it
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        if locked is None or not of_this_host(name):
            grace = max(grace, unsure_grace)
        if time.time() - st.st_mtime <= grace:
            return False
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced since it was opened
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_to_lock(name, dir_fd):
    # Read-write where allowed: over NFS a flock is a POSIX lock, and an
    # exclusive one needs a file open for writing. Nothing is written.
    base = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
    try:
        return os.open(name, os.O_RDWR | base, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY):
            raise
    return os.open(name, os.O_RDONLY | base, dir_fd=dir_fd)


def _try_lock(fd) -> Optional[bool]:
    """True: locked here (nobody else held it); False: held by a writer;
    None: the file system cannot tell."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True
