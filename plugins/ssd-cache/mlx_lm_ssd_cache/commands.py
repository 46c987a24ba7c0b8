"""``mlx-lm-ext ssd-cache stats|ls|clear --dir D``: the tier for operators.

These read file headers only and never load mlx arrays. Every walk goes
through ``safefs``: no symbolic link is ever followed, and only the names the
tier makes are looked at. ``clear`` deletes only inside a directory the tier
tagged (``CACHEDIR.TAG``), only its own regular files (entries, unfinished
``.tmp`` writes, ``.rejected`` files, the ``fingerprint.json`` notes) and the
directories they leave empty, and it shows what it would delete and asks first.
"""

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from mlx_lm_ext import safefs

PROG = "mlx-lm-ext ssd-cache"


def add_parser(subparsers: argparse._SubParsersAction, default_dir: str) -> None:
    p = subparsers.add_parser(
        "ssd-cache", help="inspect or clear the disk prompt-cache tier of the ssd-cache plugin"
    )
    actions = p.add_subparsers(dest="ssd_action", metavar="ACTION", required=True)
    for name, func, text in (
        ("stats", cmd_stats, "entries and bytes per model fingerprint"),
        ("ls", cmd_ls, "one line per stored prompt cache, most recently used first"),
        ("clear", cmd_clear, "remove stored prompt caches (asks first; tagged cache dirs only)"),
    ):
        q = actions.add_parser(name, help=text, description=text)
        q.add_argument(
            "--dir",
            "--ssd-cache-dir",  # the server's name for it, copied from its command line
            dest="dir",
            default=default_dir,
            help="cache directory (default: %(default)s)",
        )
        if name == "clear":
            _clear_flags(q)
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _clear_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--fingerprint",
        action="append",
        metavar="FP",
        help="only this fingerprint (repeatable; a prefix is enough)",
    )
    q.add_argument("-y", "--yes", action="store_true", help="delete without asking (for scripts)")
    q.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted, delete nothing"
    )


# ------------------------------------------------------------------ helpers


def _fail(message: str, status: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _root(args) -> Path:
    # Path() drops a trailing "/" or "/.", which would make the kernel follow
    # a link given as the root even with O_NOFOLLOW.
    return Path(args.dir).expanduser()


def _kind(root: Path) -> str:
    """missing | link | notdir | untagged | tagged."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "untagged"  # unreadable: nothing below can be walked either
    if stat.S_ISLNK(st.st_mode):
        return "link"
    if not stat.S_ISDIR(st.st_mode):
        return "notdir"
    return "tagged" if safefs.has_tag(root) else "untagged"


def _note(root: Path, kind: str) -> None:
    """Say why a read-only listing may show less than expected."""
    if kind == "link":
        print(f"note: {root} is a symbolic link, not followed; give the directory it points to")
    elif kind == "missing":
        print(f"note: {root} does not exist")
    elif kind == "untagged":
        print(
            f"note: {root} is not a tagged ssd-cache directory (no {safefs.TAG}); "
            "`clear` refuses it"
        )


def _wanted(fingerprint: str, prefixes: Optional[List[str]]) -> bool:
    return not prefixes or any(fingerprint.startswith(p) for p in prefixes)


def _space_files(root, fp: str, ns: str) -> List[Tuple[str, os.stat_result]]:
    """The tier's own regular files of one namespace; none if it cannot be opened."""
    try:
        with safefs.open_space(root, fp, ns) as fd:
            return safefs.files(fd)
    except (OSError, ValueError):
        return []


def _links(root, prefixes: Optional[List[str]] = None) -> int:
    """Symbolic links at the three levels of the layout (never followed)."""
    try:
        with safefs.open_dir(root) as rfd:
            n = _links_at(rfd)
            for fp in os.listdir(rfd):
                if safefs.FINGERPRINT.fullmatch(fp) and _wanted(fp, prefixes):
                    n += _links_below(rfd, fp)
            return n
    except OSError:
        return 0


def _links_below(rfd: int, fp: str) -> int:
    try:
        with safefs.open_dir(fp, rfd) as ffd:
            n = _links_at(ffd)
            for ns in os.listdir(ffd):
                if safefs.NAMESPACE.fullmatch(ns):
                    try:
                        with safefs.open_dir(ns, ffd) as nfd:
                            n += _links_at(nfd)
                    except OSError:
                        pass  # a link or not a dir: counted above, never entered
            return n
    except OSError:
        return 0


def _links_at(fd: int) -> int:
    n = 0
    for name in os.listdir(fd):
        try:
            n += stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError:
            pass
    return n


def _report_links(n: int) -> None:
    if n:
        print(f"skipped {counted(n, 'symbolic link')} inside (not followed, not removed)")


def _model_of(root, fp: str) -> str:
    """The model named in ``<fp>/fingerprint.json``, read without following links."""
    try:
        with safefs.open_dir(root) as rfd, safefs.open_dir(fp, rfd) as ffd:
            fd = safefs.open_file(ffd, safefs.INFO)
            with os.fdopen(fd, "rb") as f:
                model = str(json.loads(f.read(1 << 20)).get("model", "?"))
    except Exception:  # anyone who can write the directory writes this note too
        return "?"
    return _printable(model)


def _printable(text, limit: int = 200) -> str:
    """No terminal escapes from a file someone else may have written."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def _table(rows) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB"


# ------------------------------------------------------------------- totals


def counted(n: int, one: str, many: str = "") -> str:
    """``counted(1, "entry", "entries")`` is ``"1 entry"``; ``many`` defaults to ``one + "s"``."""
    return f"{n} {one}" if n == 1 else f"{n} {many or one + 's'}"


def entries(n: int) -> str:
    """``"1 entry"``, ``"2 entries"``: the count the tier's logs and commands print."""
    return counted(n, "entry", "entries")


def totals(root: Union[str, os.PathLike]) -> Tuple[int, int]:
    """``(entries, bytes)`` of the tier's entries under ``root`` (links not followed)."""
    n = nbytes = 0
    for fp, ns in safefs.spaces(root):
        for name, st in _space_files(root, fp, ns):
            if safefs.ENTRY.fullmatch(name):
                n, nbytes = n + 1, nbytes + st.st_size
    return n, nbytes


# -------------------------------------------------------------------- stats


def cmd_stats(args: argparse.Namespace) -> int:
    root = _root(args)
    kind = _kind(root)
    if kind == "notdir":
        _fail(f"{root} is not a directory")
    rows = [("fingerprint", "namespace", "model", "entries", "MB", "rejected", "unfinished")]
    all_n = all_bytes = 0
    for fp, ns in safefs.spaces(root):
        n = nbytes = rejected = tmp = 0
        for name, st in _space_files(root, fp, ns):
            if safefs.ENTRY.fullmatch(name):
                n, nbytes = n + 1, nbytes + st.st_size
            elif safefs.REJECTED.fullmatch(name):
                rejected += 1
            else:
                tmp += 1
        rows.append((fp, ns, _model_of(root, fp), n, f"{nbytes / 1e6:.1f}", rejected, tmp))
        all_n, all_bytes = all_n + n, all_bytes + nbytes
    _note(root, kind)
    print(f"{root}: {entries(all_n)}, {_gb(all_bytes)}")
    if len(rows) > 1:
        _table(rows)
    _report_links(_links(root))
    return 0


# ----------------------------------------------------------------------- ls


def _ls_row(fileformat, space_fd: int, name: str, st: os.stat_result):
    """``(mtime, tokens, type, size, status)`` of one file; never raises."""
    if safefs.REJECTED.fullmatch(name):
        return st.st_mtime, "?", "?", st.st_size, "rejected"
    try:
        h = fileformat.read_header(name, dir_fd=space_fd)  # opened without links
        meta = fileformat.entry_meta(h)
        return h.mtime, meta["n_tokens"], _printable(meta["cache_type"]), h.size, "ok"
    except Exception as e:  # a listing must survive any file an attacker can write
        return st.st_mtime, "?", "?", st.st_size, f"corrupt: {_printable(e)}"


def cmd_ls(args: argparse.Namespace) -> int:
    from . import fileformat  # imports mlx: only when listing

    root = _root(args)
    kind = _kind(root)
    if kind == "notdir":
        _fail(f"{root} is not a directory")
    rows, tmp, now = [], 0, time.time()
    for fp, ns in safefs.spaces(root):
        try:
            with safefs.open_space(root, fp, ns) as fd:
                for name, st in safefs.files(fd):
                    if safefs.TEMP.fullmatch(name):
                        tmp += 1
                        continue
                    mtime, tokens, ctype, size, status = _ls_row(fileformat, fd, name, st)
                    rows.append(
                        (
                            mtime,
                            (
                                f"{fp}/{ns}",
                                name[:16],
                                tokens,
                                ctype,
                                f"{size / 1e6:.1f}",
                                f"{(now - mtime) / 60:.0f} min",
                                status,
                            ),
                        )
                    )
        except (OSError, ValueError):
            continue  # replaced by a link or removed since it was listed
    _note(root, kind)
    if rows:
        rows.sort(key=lambda r: -r[0])
        _table(
            [("fingerprint/namespace", "entry", "tokens", "type", "MB", "last used", "status")]
            + [r for _, r in rows]
        )
    else:
        print(f"{root}: no entries")
    if tmp:
        print(f"{counted(tmp, 'unfinished write')} (.tmp)")
    _report_links(_links(root))
    return 0


# -------------------------------------------------------------------- clear


def _check_clearable(root: Path, kind: str) -> None:
    if kind == "link":
        _fail(f"{root} is a symbolic link; give the directory it points to")
    if kind == "notdir":
        _fail(f"{root} is not a directory")
    if kind == "untagged":
        _fail(f"{root} is not an ssd-cache directory (no {safefs.TAG}); nothing deleted")


def _plan(root: Path, prefixes) -> Dict[Tuple[str, str], List[Tuple[str, int]]]:
    """``{(fp, ns): [(name, size)]}``: what clear would delete."""
    plan = {}
    for fp, ns in safefs.spaces(root):
        if _wanted(fp, prefixes):
            plan[fp, ns] = [(name, st.st_size) for name, st in _space_files(root, fp, ns)]
    return plan


def _show_plan(root: Path, plan) -> Tuple[int, int]:
    rows = [("fingerprint/namespace", "files", "MB")]
    n = nbytes = 0
    for (fp, ns), items in plan.items():
        size = sum(s for _, s in items)
        if items:
            rows.append((f"{fp}/{ns}", len(items), f"{size / 1e6:.1f}"))
        n, nbytes = n + len(items), nbytes + size
    if n:
        print(f"{root}: would delete")
        _table(rows)
        print(f"total: {counted(n, 'file')}, {_gb(nbytes)}")
    return n, nbytes


def _confirm(n: int, nbytes: int) -> bool:
    # The question goes to stderr (as rm -i does) so that stdout stays the listing.
    print(
        f"Delete {counted(n, 'file')} ({_gb(nbytes)})? [y/N] ", end="", file=sys.stderr, flush=True
    )
    try:
        answer = sys.stdin.readline()
    except (KeyboardInterrupt, EOFError):
        answer = ""
    if not answer.endswith("\n"):
        print(file=sys.stderr)
    return answer.strip().lower() in ("y", "yes")


def _remove(fd: int, name: str) -> Optional[bool]:
    """Remove one planned file; None for an unfinished write still under way.

    A temp file goes at once if nobody holds its lock (its writer is gone),
    never while one does, however old: clearing must not pull a live
    server's write from under it.
    """
    if safefs.TEMP.fullmatch(name):
        return True if safefs.reap(fd, name, grace=0.0, unsure_grace=0.0) else None
    return safefs.unlink(fd, name)


def _delete(root: Path, plan) -> Tuple[int, int, int]:
    """Remove exactly the planned files: ``(removed, bytes, failures)``."""
    n = nbytes = failed = live = 0
    for (fp, ns), items in plan.items():
        try:
            with safefs.open_space(root, fp, ns) as fd:
                for name, size in items:
                    try:
                        done = _remove(fd, name)
                        live += done is None
                        if done:
                            n, nbytes = n + 1, nbytes + size
                    except OSError as e:
                        failed += 1
                        print(f"{PROG}: cannot remove {fp}/{ns}/{name}: {e}", file=sys.stderr)
        except (OSError, ValueError) as e:
            # replaced by a link or removed since it was listed: leave it alone
            failed += bool(items)
            print(f"{PROG}: skipped {fp}/{ns}: {e}", file=sys.stderr)
            continue
        safefs.remove_space_if_empty(root, fp, ns)
    if live:
        print(f"left {live} unfinished write{'s' * (live != 1)} that a running server holds")
    return n, nbytes, failed


def cmd_clear(args: argparse.Namespace) -> int:
    root = _root(args)
    kind = _kind(root)
    if kind == "missing":
        print(f"{root}: no such directory, nothing to clear")
        return 0
    _check_clearable(root, kind)
    plan = _plan(root, args.fingerprint)
    n, nbytes = _show_plan(root, plan)
    _report_links(_links(root, args.fingerprint))
    if not n:
        print(f"{root}: nothing to delete")
        return 0
    if args.dry_run:
        print("dry run: nothing deleted")
        return 0
    if not args.yes:
        if sys.stdin is None or not sys.stdin.isatty():
            _fail("stdin is not a terminal: pass --yes to delete without asking")
        if not _confirm(n, nbytes):
            print("nothing deleted")
            return 1
    removed, removed_bytes, failed = _delete(root, plan)
    print(f"removed {counted(removed, 'file')}, {_gb(removed_bytes)} from {root}")
    return 1 if failed else 0
