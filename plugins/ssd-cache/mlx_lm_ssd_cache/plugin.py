"""The ssd-cache plugin's hooks (entry point ``ssd-cache``)."""

import functools
import logging
import re
import sys
from pathlib import Path

from mlx_lm_ext import PluginError, hookimpl

DEFAULT_BYTES = "8G"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

_config = {}  # validated options of the active command
_undo = []


def default_dir():
    import platformdirs

    return str(Path(platformdirs.user_cache_dir("mlx-lm-ext")) / "ssd-cache")


def parse_bytes(text):
    """``"512M"`` -> 536870912. K/M/G/T are powers of 1024; a B/iB tail is fine."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise PluginError(
            f"--ssd-cache-bytes: {text!r} is not a size (examples: 500M, 20G, 1T)"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise PluginError(f"--ssd-cache-bytes: {text!r} must be more than 0 bytes")
    return value


def check_dir(text):
    """The cache directory, refusing paths that can never be one."""
    if not text or not str(text).strip():
        raise PluginError("--ssd-cache-dir: empty path")
    path = Path(str(text)).expanduser()
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                what = "is" if p == path else f"is under {p}, which is"
                raise PluginError(f"--ssd-cache-dir: {path} {what} not a directory")
            break
    return path


def options(args):
    """Validated ``(directory, byte cap, verify)`` from parsed arguments."""
    directory = getattr(args, "ssd_cache_dir", None) or default_dir()
    return (
        check_dir(directory),
        parse_bytes(getattr(args, "ssd_cache_bytes", None) or DEFAULT_BYTES),
        bool(getattr(args, "ssd_cache_verify", False)),
    )


def _world_size():
    import mlx.core as mx

    if not mx.distributed.is_available():
        return 1
    return mx.distributed.init().size()


@hookimpl
def commands():
    return ["server"]


@hookimpl
def add_arguments(command, group):
    if command not in ("server", "python"):
        return
    group.add_argument(
        "--ssd-cache-dir",
        default=default_dir(),
        metavar="DIR",
        help="Directory of the disk prompt-cache tier (default: %(default)s). "
        "Entries live in DIR/<model fingerprint>/<namespace>/.",
    )
    group.add_argument(
        "--ssd-cache-bytes",
        default=DEFAULT_BYTES,
        metavar="SIZE",
        help="Disk cap for this model's entries, with K/M/G/T suffixes "
        "(default: %(default)s). Least recently used entries are removed first.",
    )
    group.add_argument(
        "--ssd-cache-verify",
        action="store_true",
        help="Check every tensor's CRC32 on restore (slower restores; catches "
        "corrupted data, not only corrupted headers).",
    )


@hookimpl
def activate(command, args):
    directory, cap, verify = options(args)
    size = _world_size()
    if size > 1:
        raise PluginError(
            f"ssd-cache does not support distributed serving (world size {size}): "
            "every rank would have to make the same restore decisions"
        )
    _config.update(directory=directory, max_bytes=cap, verify=verify)
    if command == "server":
        _patch_log_line()


@hookimpl
def deactivate():
    from . import disk

    disk.flush_all(timeout=60)
    while _undo:
        _undo.pop()()
    _config.clear()


@hookimpl
def make_prompt_cache(args, max_size):
    from .cache import SSDPromptCache

    directory, cap, verify = (
        (_config["directory"], _config["max_bytes"], _config["verify"])
        if _config
        else options(args)
    )
    settings = {
        k: getattr(args, k, None)
        for k in ("kv_bits", "kv_group_size", "quantized_kv_start")
    }
    cache = SSDPromptCache(
        max_size, directory=directory, disk_bytes=cap, verify=verify, settings=settings
    )
    model = getattr(args, "model", None)
    if model:
        # The server's key for its default model; identify and scan its
        # directory while the model loads.
        cache.disk.prepare(
            (model, getattr(args, "adapter_path", None), getattr(args, "draft_model", None))
        )
    return cache


@hookimpl
def add_subcommands(subparsers):
    from . import commands as ops

    ops.add_parser(subparsers, default_dir())


@hookimpl
def doctor():
    from . import commands as ops

    directory = default_dir()
    n, nbytes = ops.totals(Path(directory))
    return [("default dir", f"{directory} ({n} entries, {nbytes / 1e9:.2f} GB)")]


def _patch_log_line():
    """Add the disk tier to the server's "Prompt Cache: ..." log lines."""
    server = sys.modules.get("mlx_lm.server")
    if server is None or getattr(server.ResponseGenerator._log_cache_stats, "_ssd", False):
        return
    original = server.ResponseGenerator._log_cache_stats

    @functools.wraps(original)
    def _log_cache_stats(self):
        original(self)
        stats = getattr(self.prompt_cache, "disk_stats", None)
        if not callable(stats):
            return
        s = stats()
        avg = s["restore_s"] / s["hits"] if s["hits"] else 0.0
        logging.info(
            f"- disk: {s['entries']} entries, {s['bytes'] / 1e9:.2f} GB, "
            f"{s['hits']} hits / {s['lookups']} lookups, "
            f"{s['restored_tokens']} tokens restored in {s['restore_s']:.2f} s "
            f"(avg {avg:.3f} s), {s['pending']} writes pending"
        )

    _log_cache_stats._ssd = True
    server.ResponseGenerator._log_cache_stats = _log_cache_stats
    _undo.append(lambda: setattr(server.ResponseGenerator, "_log_cache_stats", original))
