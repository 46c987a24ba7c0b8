"""The ``mlx-lm-ext`` command: plugins, doctor, model, status, and plugin subcommands.

``mlx-lm-ext generate|server|lora|... ARGS`` (and ``python -m mlx_lm_ext``)
also runs mlx-lm's own command with the plugins wired in, for interpreters
where the start-up ``.pth`` hook does not run.
"""

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
import time
from typing import List, Optional, Sequence

from . import __version__, compat, plugins

# mlx-lm's own subcommands (mlx_lm/cli.py), run through with plugins enabled.
MLX_LM_COMMANDS = (
    "awq",
    "benchmark",
    "cache_prompt",
    "chat",
    "convert",
    "dwq",
    "dynamic_quant",
    "evaluate",
    "fuse",
    "generate",
    "gptq",
    "lora",
    "manage",
    "perplexity",
    "server",
    "share",
    "upload",
)
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def run_mlx_lm(command: str, argv: List[str]) -> Optional[int]:
    """Run ``mlx_lm <command>`` with the start-up hook installed first."""
    from . import _boot

    _boot.install()
    from mlx_lm import cli as mlx_cli  # mlx-lm's own dispatcher

    sys.argv = ["mlx_lm", command, *argv]
    return mlx_cli.main()


# ---------------------------------------------------------------- plugins


def cmd_plugins(args: argparse.Namespace) -> int:
    found = plugins.installed()
    if not found:
        print("No plugins installed. Install one, e.g. pip install -e plugins/spec-decode")
        return 0
    rows = [("plugin", "distribution", "version", "extends")]
    for name in sorted(found):
        dist, version = plugins.distribution(name)
        try:
            extends = ", ".join(f"mlx_lm.{c}" for c in plugins.commands_of(name))
        except plugins.PluginError as e:
            extends = f"(broken: {e})"
        rows.append((name, dist, version, extends or "-"))
    _print_table(rows)
    return 0


def _print_table(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())


# ----------------------------------------------------------------- doctor


def _hook_installed():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    for d in dirs:
        if os.path.exists(os.path.join(d, "mlx_lm_ext.pth")):
            return os.path.join(d, "mlx_lm_ext.pth")
    return None


def _blas_report(mx):
    """On Linux CPU: which BLAS MLX uses, and a measured float32 GFLOP/s."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    openblas = "libopenblas" in maps
    n = 512
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        mx.eval(a @ b)
    gflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    if openblas:
        return f"OpenBLAS loaded ({gflops:.0f} GFLOP/s float32 matmul)"
    hint = f"apt-get install libopenblas0-pthread and run with LD_PRELOAD={OPENBLAS}"
    return f"bundled reference BLAS ({gflops:.1f} GFLOP/s float32 matmul): slow; {hint}"


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import _boot

    lines = [("mlx-lm-ext", __version__)]
    lines.append(("python", f"{platform.python_version()} ({sys.executable})"))
    try:
        import mlx.core as mx
    except ImportError as e:
        lines.append(("mlx", f"not importable: {e}; install mlx-lm-ext[cpu] or [cuda]"))
        _print_table(lines)
        return 1
    lines.append(("mlx", importlib.metadata.version("mlx")))
    problem = compat.problem()
    lines.append(
        ("mlx-lm", compat.mlx_lm_version() + (f"  ({problem})" if problem else "  (supported)"))
    )
    from . import models

    backend = models.backend()
    lines.append(("backend", f"{backend} (default device {mx.default_device()})"))
    fast = models.fast_model(backend)
    why = (
        "float32: MLX's CPU kernels for 4-bit weights are much slower"
        if backend == "CPU"
        else "4-bit"
    )
    lines.append(("fast offline model", f"{fast} ({why}; mlx-lm-ext model {fast})"))
    pth = _hook_installed()
    if pth and _boot.active():
        hook = f"active ({pth})"
    elif pth:
        hook = f"installed but not running in this process ({pth}); use python -m mlx_lm_ext"
    else:
        hook = "not installed: use python -m mlx_lm_ext <command> ..."
    lines.append(("start-up hook", hook))
    if backend == "CPU" and sys.platform.startswith("linux"):
        lines.append(("BLAS", _blas_report(mx)))
    lines.append(("plugins", ", ".join(sorted(plugins.installed())) or "none"))
    for name in sorted(plugins.installed()):
        try:
            extra = plugins.call(plugins.load(name), "doctor") or []
        except Exception as e:
            extra = [("error", repr(e))]
        lines += [(f"{name}: {label}", value) for label, value in extra]
    _print_table(lines)
    return 1 if problem else 0


# ------------------------------------------------------------------ model


def cmd_model(args: argparse.Namespace) -> int:
    from . import models, standin

    names = (*models.NAMES, standin.NAME)
    if args.list or not args.name:
        for name in names:
            print(name)
        return 0
    if args.name not in names:
        plugins.fail(f"unknown model '{args.name}' (models: {', '.join(names)})")
    options = {"size": args.size, "layers": args.layers, "dtype": args.dtype, "seed": args.seed}
    given = [f"--{k}" for k, v in options.items() if v is not None]
    if args.name != standin.NAME and given:
        plugins.fail(f"{', '.join(given)}: only for {standin.NAME}")
    if args.name == standin.NAME and args.size is None:
        plugins.fail(f"{standin.NAME} needs --size (e.g. --size 1B, 3B or 10B)")
    request = {
        "layers": args.layers or 0,
        "dtype": args.dtype or "bfloat16",
        "seed": args.seed or 0,
    }
    try:
        if args.name != standin.NAME:
            path = models.build(args.name, progress=not args.quiet)
        else:
            meta = models.read_gguf(models.gguf_path())[1]
            try:  # input errors (size, layers, seed) before any work
                standin.request(args.size, meta=meta, **request)
            except models.ModelError as e:
                plugins.fail(str(e))
            path = standin.build(args.size, progress=not args.quiet, **request)
    except (OSError, RuntimeError, ValueError) as e:
        plugins.fail(str(e), status=1)
    print(path)
    return 0


# ----------------------------------------------------------------- status


def status_url(url: str) -> str:
    """``http://host:port[/status[.json]]`` -> the server's ``/status.json``."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        plugins.fail(f"not a server URL: {url!r} (example: http://127.0.0.1:8080)")
    path = parts.path.rstrip("/")
    for tail in ("/status.json", "/status", "/metrics"):
        if path.endswith(tail):
            path = path[: -len(tail)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/status.json", "", ""))


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    from . import status_page

    url = status_url(args.url)
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        why = "its status routes are off (--no-status)" if e.code == 404 else f"HTTP {e.code}"
        print(f"mlx-lm-ext: error: {url}: {why}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"mlx-lm-ext: error: {url}: {e}", file=sys.stderr)
        return 1
    print(status_page.text(doc), end="")
    return 0


# ------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-lm-ext",
        description="Plugins for mlx-lm. Also runs mlx-lm's commands with plugins "
        f"wired in: mlx-lm-ext {{{','.join(MLX_LM_COMMANDS[:3])},...}} ARGS.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="installed plugins and the commands they extend")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("doctor", help="versions, backend, start-up hook, BLAS, plugin checks")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("model", help="print the path of a ready offline model, building it once")
    p.add_argument("name", nargs="?", help="e.g. smollm2-135m or smollm2-135m-f32")
    p.add_argument("--list", action="store_true", help="list the models that can be built")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("smollm2-standin (SmolLM2's predictions at a large model's cost)")
    g.add_argument("--size", help="parameter count, e.g. 500M, 1B, 3B, 10B (the MLP is widened)")
    g.add_argument(
        "--layers", type=int, metavar="N", help="zero-output layers to add first (default 0)"
    )
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default bfloat16")
    g.add_argument("--seed", type=int, metavar="N", help="seed of the extra weights (default 0)")
    p.set_defaults(func=cmd_model)
    p = sub.add_parser("status", help="a running server's figures (its /status.json)")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default 10)")
    p.set_defaults(func=cmd_status)
    for name in sorted(plugins.installed()):
        try:
            plugins.call(plugins.load(name), "add_subcommands", subparsers=sub)
        except Exception as e:
            print(f"mlx-lm-ext: plugin '{name}' could not add its commands: {e}", file=sys.stderr)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Optional[int]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MLX_LM_COMMANDS:
        return run_mlx_lm(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
