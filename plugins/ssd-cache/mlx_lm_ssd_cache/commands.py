"""``mlx-lm-ext ssd-cache stats|ls|clear --dir D``: the tier for operators.

These read file headers only and never load mlx arrays. ``clear`` removes
only files this plugin writes (entries, unfinished ``.tmp`` writes, the
``fingerprint.json`` notes) and the directories they leave empty.
"""

import json
import os
import sys
import time
from pathlib import Path

INFO = "fingerprint.json"  # written by the tier next to the namespace dirs
SUFFIX = ".safetensors"


def add_parser(subparsers, default_dir):
    p = subparsers.add_parser(
        "ssd-cache", help="inspect or clear the disk prompt-cache tier of the ssd-cache plugin"
    )
    actions = p.add_subparsers(dest="ssd_action", metavar="ACTION", required=True)
    for name, func, text in (
        ("stats", cmd_stats, "entries and bytes per model fingerprint"),
        ("ls", cmd_ls, "one line per stored prompt cache, most recently used first"),
        ("clear", cmd_clear, "remove stored prompt caches"),
    ):
        q = actions.add_parser(name, help=text, description=text)
        q.add_argument("--dir", default=default_dir, help="cache directory (default: %(default)s)")
        if name == "clear":
            q.add_argument(
                "--fingerprint", action="append", metavar="FP",
                help="only this fingerprint (repeatable; a prefix is enough)",
            )
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _spaces(root):
    """``(fingerprint dir, namespace dir)`` pairs under ``root``."""
    if not root.is_dir():
        return []
    out = []
    for fp in sorted(root.iterdir()):
        if fp.is_dir():
            out += [(fp, ns) for ns in sorted(fp.iterdir()) if ns.is_dir()]
    return out


def _files(ns):
    try:
        return sorted(ns.iterdir())
    except OSError:
        return []


def totals(root):
    n = nbytes = 0
    for _, ns in _spaces(root):
        for f in _files(ns):
            if f.name.endswith(SUFFIX):
                try:
                    nbytes += f.stat().st_size
                    n += 1
                except OSError:
                    pass
    return n, nbytes


def _model_of(fp):
    try:
        return json.loads((fp / INFO).read_text()).get("model", "?")
    except (OSError, ValueError):
        return "?"


def _root(args):
    root = Path(args.dir).expanduser()
    if root.exists() and not root.is_dir():
        print(f"mlx-lm-ext ssd-cache: error: {root} is not a directory", file=sys.stderr)
        raise SystemExit(2)
    return root


def _table(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_stats(args):
    root = _root(args)
    rows = [("fingerprint", "namespace", "model", "entries", "MB", "unfinished")]
    all_n = all_bytes = 0
    for fp, ns in _spaces(root):
        n = nbytes = tmp = 0
        for f in _files(ns):
            if f.name.endswith(SUFFIX):
                n += 1
                nbytes += f.stat().st_size
            elif f.name.endswith(".tmp"):
                tmp += 1
        rows.append((fp.name, ns.name, _model_of(fp), n, f"{nbytes / 1e6:.1f}", tmp))
        all_n, all_bytes = all_n + n, all_bytes + nbytes
    print(f"{root}: {all_n} entries, {all_bytes / 1e9:.3f} GB")
    if len(rows) > 1:
        _table(rows)
    return 0


def cmd_ls(args):
    from . import fileformat  # imports mlx: only when listing

    root = _root(args)
    rows = []
    now = time.time()
    for fp, ns in _spaces(root):
        for f in _files(ns):
            if not f.name.endswith(SUFFIX):
                continue
            try:
                h = fileformat.read_header(f)
                meta = fileformat.entry_meta(h)
                status = "ok"
                tokens, kind = meta["n_tokens"], meta["cache_type"]
                size, mtime = h.size, h.mtime
            except (fileformat.Corrupt, OSError) as e:
                st = f.stat() if f.exists() else None
                tokens, kind, status = "?", "?", f"corrupt: {e}"
                size, mtime = (st.st_size, st.st_mtime) if st else (0, 0)
            rows.append((mtime, (f"{fp.name}/{ns.name}", f.name[:16], tokens, kind,
                                 f"{size / 1e6:.1f}", f"{(now - mtime) / 60:.0f} min", status)))
    if not rows:
        print(f"{root}: no entries")
        return 0
    rows.sort(key=lambda r: -r[0])
    _table([("fingerprint/namespace", "entry", "tokens", "type", "MB", "last used", "status")]
           + [r for _, r in rows])
    return 0


def cmd_clear(args):
    root = _root(args)
    wanted = args.fingerprint or []
    n = nbytes = 0
    for fp, ns in _spaces(root):
        if wanted and not any(fp.name.startswith(w) for w in wanted):
            continue
        for f in _files(ns):
            if f.name.endswith(SUFFIX) or f.name.endswith(".tmp"):
                try:
                    size = f.stat().st_size
                    f.unlink()
                    n, nbytes = n + 1, nbytes + size
                except OSError as e:
                    print(f"mlx-lm-ext ssd-cache: cannot remove {f}: {e}", file=sys.stderr)
        _rmdir(ns)
        if not any(p.is_dir() for p in fp.iterdir()):
            try:
                (fp / INFO).unlink()
            except OSError:
                pass
            _rmdir(fp)
    print(f"removed {n} files, {nbytes / 1e9:.3f} GB from {root}")
    return 0


def _rmdir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass
