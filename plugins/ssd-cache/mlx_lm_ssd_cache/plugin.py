"""The ssd-cache plugin's hooks (entry point ``ssd-cache``)."""

import argparse
import errno
import logging
import os
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from mlx_lm_ext.api import PluginError, hookimpl

if TYPE_CHECKING:
    from .cache import SSDPromptCache

DEFAULT_BYTES = "8G"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# The server's model key -> weak references to the loaded model and mlx-lm
# draft model: restores are checked against the caches these make.
_live = {}


def default_dir() -> str:
    import platformdirs

    return str(Path(platformdirs.user_cache_dir("mlx-lm-ext")) / "ssd-cache")


def parse_bytes(text: Union[str, int]) -> int:
    """``"512M"`` -> 536870912. K/M/G/T are powers of 1024; a B/iB tail is fine."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise PluginError(f"--ssd-cache-bytes: {text!r} is not a size (examples: 500M, 20G, 1T)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise PluginError(f"--ssd-cache-bytes: {text!r} must be more than 0 bytes")
    return value


def check_dir(text: Union[str, Path]) -> Path:
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


def options(args: argparse.Namespace) -> Tuple[Path, int, bool]:
    """Validated ``(directory, byte cap, verify)`` from parsed arguments."""
    directory = getattr(args, "ssd_cache_dir", None)
    if directory is None:
        directory = default_dir()
    return (
        check_dir(directory),
        parse_bytes(getattr(args, "ssd_cache_bytes", None) or DEFAULT_BYTES),
        bool(getattr(args, "ssd_cache_verify", True)),
    )


def _world_size():
    import mlx.core as mx

    if not mx.distributed.is_available():
        return 1
    return mx.distributed.init().size()


@hookimpl
def commands() -> List[str]:
    return ["server"]


@hookimpl
def add_arguments(command: str, group: argparse._ArgumentGroup) -> None:
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
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Check every tensor's CRC32 on restore (the default: a corrupt "
        "entry is a miss). --no-ssd-cache-verify skips the check and stores "
        "nothing that extends an unchecked restore.",
    )


@hookimpl
def activate(command: str, args: argparse.Namespace) -> Dict[str, Any]:
    directory, cap, verify = options(args)
    size = _world_size()
    if size > 1:
        raise PluginError(
            f"ssd-cache does not support distributed serving (world size {size}): "
            "every rank would have to make the same restore decisions"
        )
    tier, reason = _claim(directory)
    return {
        "directory": directory,
        "max_bytes": cap,
        "verify": verify,
        "tier": tier,
        "tier_reason": reason,
    }


def _claim(directory):
    """Create and tag the cache directory, and check that a file can be written in it.

    ``(tier, reason)``: ``("on", "")``; ``("read-only", why)`` for a cache
    directory that can be read but not written (its entries are still
    restored, nothing is stored); ``("off", why)`` when there is no cache
    directory to read either (the server keeps mlx-lm's memory cache alone).
    Refuses (``PluginError``) a directory that holds other files.
    """
    from mlx_lm_ext import safefs

    try:
        safefs.make_root(directory)
        _probe_write(directory)
    except safefs.NotACache as e:
        raise PluginError(f"--ssd-cache-dir: {e}") from None
    except OSError as e:  # read-only, full, no permission: never fatal
        tier = "read-only" if safefs.has_tag(directory) else "off"
        what = "restores only, nothing is stored" if tier == "read-only" else "the disk tier is off"
        logging.getLogger("mlx_lm_ssd_cache").warning(
            "ssd-cache: cannot write to %s: %s; %s", directory, _os_error(e), what
        )
        return tier, _os_error(e)
    return "on", ""


def _probe_write(directory):
    """Create, write, sync and remove one temp file in ``directory`` (``OSError`` if not)."""
    from mlx_lm_ext import safefs

    with safefs.open_dir(directory) as dfd:
        name = safefs.temp_name("write-check")
        fd = safefs.create_temp(name, dfd)
        try:
            os.write(fd, b"ssd-cache write check\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dfd)


def _os_error(e):
    """``Permission denied (EACCES)``: the error without its file (the warning names the path)."""
    if not e.strerror:
        return str(e)
    return f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"


@hookimpl
def deactivate() -> None:
    from . import disk

    disk.flush_all(timeout=60)
    _live.clear()


@hookimpl
def model_loaded(model_key: Any, model: Any, draft_model: Any) -> None:
    models = [m for m in (model, draft_model) if m is not None]
    try:
        _live[model_key] = [weakref.ref(m) for m in models]
    except TypeError:  # an unhashable key is not the server's
        pass


def live_models(model_key: Any) -> Optional[List[Any]]:
    """The loaded models of ``model_key``, or None when not (or no longer) loaded."""
    try:
        refs = _live.get(model_key)
    except TypeError:
        return None
    models = [r() for r in refs or ()]
    return models if models and all(m is not None for m in models) else None


def _extra_classes():
    from mlx_lm_ext.api import prompt_cache_classes

    return prompt_cache_classes()


@hookimpl
def make_prompt_cache(
    args: Optional[argparse.Namespace], options: Dict[str, Any], max_size: int, max_bytes: int
) -> "SSDPromptCache":
    from .cache import SSDPromptCache

    directory, cap, verify = options["directory"], options["max_bytes"], options["verify"]
    tier = options.get("tier", "on")
    if tier == "off":
        return None  # mlx-lm's own cache; the warning was logged at start-up
    settings = {
        k: getattr(args, k, None) for k in ("kv_bits", "kv_group_size", "quantized_kv_start")
    }
    cache = SSDPromptCache(
        max_size,
        max_bytes,
        directory=directory,
        disk_bytes=cap,
        verify=verify,
        writable=tier == "on",
        settings=settings,
        live_models=live_models,
        extra_classes=_extra_classes,
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
def add_subcommands(subparsers: Any) -> None:
    from . import commands as ops

    ops.add_parser(subparsers, default_dir())


@hookimpl
def doctor() -> List[Tuple[str, str]]:
    from . import commands as ops

    directory = default_dir()
    n, nbytes = ops.totals(Path(directory))
    return [("default dir", f"{directory} ({ops.entries(n)}, {nbytes / 1e9:.2f} GB)")]


@hookimpl
def report_lines(command: str, source: Any) -> Optional[List[str]]:
    """The disk tier's line under the server's "Prompt Cache: ..." log lines."""
    stats = getattr(source, "disk_stats", None)
    if command != "server" or not callable(stats):
        return None
    from .commands import entries

    s = stats()
    avg = s["restore_s"] / s["hits"] if s["hits"] else 0.0
    return [
        f"- disk: {entries(s['entries'])}, {s['bytes'] / 1e9:.2f} GB, "
        f"{s['hits']} hits / {s['lookups']} lookups, "
        f"{s['restored_tokens']} tokens restored in {s['restore_s']:.2f} s "
        f"(avg {avg:.3f} s), {s['pending']} writes pending"
        + ("" if s.get("writable", True) else ", read-only (nothing is stored)")
    ]


@hookimpl
def metrics(prompt_cache: Any, options: Any) -> Optional[List[Any]]:
    """The disk tier's series for the server's /metrics and /status."""
    from . import metrics as series

    return series.families(prompt_cache, options)


@hookimpl
def status_charts() -> List[Tuple[str, str, str]]:
    from . import metrics as series

    return series.CHARTS
