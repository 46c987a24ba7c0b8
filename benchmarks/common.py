"""Picking the target model of the spec-decode benchmarks: SmolLM2-135M or a stand-in.

``--standin SIZE`` makes the target the memory-bound stand-in (``mlx_lm_ext.standin``):
SmolLM2-135M with its MLPs widened to SIZE parameters by rows whose output is
zero, so it costs what a large model costs per forward and predicts exactly
what SmolLM2 does (in float32). In-process benchmarks build it in memory
(``load_target``); those that start servers build the cached folder
(``target_path``). Drafters made from SmolLM2 (its 4-bit copy, an assistant
trained on it) predict the stand-in unrealistically well: see the README.
"""

import argparse
import os

from mlx_lm_ext import models, standin

BASE = "smollm2-135m-f32"


DTYPES = ("float32", "bfloat16", "float16")


def add_device_args(p: argparse.ArgumentParser, device=None) -> None:
    """``--device cpu|gpu`` (default ``device``; None: MLX's own) and ``--dtype``."""
    default = device or "MLX's"
    p.add_argument("--device", choices=("cpu", "gpu"), default=device, help=f"default: {default}")
    p.add_argument("--dtype", choices=DTYPES, default="float32")


def set_device(args: argparse.Namespace) -> None:
    """``args.device`` as MLX's default device, where one was given."""
    if args.device:
        import mlx.core as mx

        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)


def _size(text):
    try:
        standin.parse_size(text)
    except models.ModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def add_target_args(p: argparse.ArgumentParser, dtype: bool = False) -> None:
    """``--standin SIZE`` and ``--standin-layers N`` (and ``--standin-dtype`` if ``dtype``)."""
    g = p.add_argument_group("target model (default: SmolLM2-135M float32)")
    g.add_argument(
        "--standin",
        metavar="SIZE",
        type=_size,
        default=None,
        help="target the memory-bound stand-in of SIZE parameters (e.g. 1B, 10B): a large "
        "model's cost with SmolLM2's predictions",
    )
    g.add_argument(
        "--standin-layers",
        type=int,
        default=0,
        metavar="N",
        help="zero-output layers the stand-in adds before widening its MLPs (default 0)",
    )
    if dtype:
        g.add_argument(
            "--standin-dtype",
            choices=tuple(standin.DTYPES),
            default="float32",
            help="the stand-in's dtype (default float32: exactly SmolLM2's predictions)",
        )


def batch_levels(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """``(concurrency levels, prompt kinds)`` from ``--concurrency`` and ``--kinds``;
    a bad value is ``ap.error`` (exit 2)."""
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        assert levels and min(levels) >= 1
    except (ValueError, AssertionError):
        ap.error(f"--concurrency: comma-separated positive integers, got {args.concurrency!r}")
    kinds = args.kinds.split(",")
    if not set(kinds) <= {"grounded", "open"}:
        ap.error(f"--kinds: grounded and/or open, got {args.kinds!r}")
    return levels, kinds


def target_name(args: argparse.Namespace, dtype: str = "float32") -> str:
    """How tables name the target, e.g. ``SmolLM2-135M stand-in 10B (bfloat16)``."""
    dtype = getattr(args, "standin_dtype", dtype) if args.standin else dtype
    if not args.standin:
        return f"SmolLM2-135M {dtype}"
    n = args.standin_layers
    layers = f" +{n} layer{'s' if n != 1 else ''}" if n else ""
    return f"SmolLM2-135M stand-in {args.standin}{layers} ({dtype})"


def load_target(args: argparse.Namespace, dtype: str = "float32"):
    """``(model, tokenizer)``: SmolLM2 float32 cast to ``dtype``, widened in memory if asked."""
    import mlx.core as mx
    from mlx_lm import load

    if args.standin:
        dtype = getattr(args, "standin_dtype", dtype)
        return standin.load(args.standin, layers=args.standin_layers, dtype=dtype)
    model, tokenizer = load(str(models.build(BASE, progress=False)))
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def target_path(args: argparse.Namespace, dtype: str = "float32"):
    """The target's folder: SmolLM2 float32, or the stand-in built (once, cached) in ``dtype``."""
    if not args.standin:
        return models.build(BASE, progress=False)
    return standin.build(args.standin, layers=args.standin_layers, dtype=dtype)


def load_assistant(args: argparse.Namespace, path, target, **options):
    """``assistant.load(path, target, **options)``; for a stand-in, checked against SmolLM2.

    A drafter trained on SmolLM2 is refused for the stand-in (its config
    differs), yet reads the same thing from it: the stand-in's first layers'
    K/V (the donors) and its final hidden state are SmolLM2's. So the drafter
    is checked against SmolLM2 and then drives the stand-in.
    """
    from mlx_lm import load

    from mlx_lm_spec_decode import assistant
    from mlx_lm_spec_decode import target as target_mod

    if not args.standin:
        return assistant.load(path, target, **options)
    cfg = assistant.read_config(path)
    base, _ = load(str(models.build(BASE, progress=False)))
    assistant.check_fingerprint(cfg.target, assistant.fingerprint(base), where=str(path))
    if max(cfg.donors) >= len(base.layers):
        raise assistant.AssistantError(f"{path}: donor layers {cfg.donors} outside SmolLM2's")
    net = assistant.load_net(path, cfg)
    split = target_mod.split(target)
    return assistant.AssistantDrafter(target, net, cfg, split=split, **options)


# ------------------------------------------------------------ run records
#
# Every benchmark opens its output with ``header_line()`` (the commit, the
# machine, the versions, the command) so that a results file names what it
# ran at; times carry the statistic they are (``Timing.statistic``); tables
# are markdown; ``dump_json`` writes the figures with the same header.


def _git(*args: str) -> str:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files differ from it.

    A copy of the tree without its git folder (a GPU machine) takes
    ``BENCH_COMMIT`` from the environment, as the copy's sender names it.
    """
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a run measured: OS, CPU, core count, load, GPU, MLX's device."""
    import importlib.metadata as md
    import platform

    import mlx.core as mx

    info = {
        "os": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "gpu": None,
    }
    if mx.default_device() == mx.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name")
        except Exception:  # an older MLX: the device is named, not described
            info["gpu"] = "gpu"
    for name in ("mlx", "mlx-lm"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    return info


def command(argv=None) -> str:
    """The command line as typed from the repository root: ``python benchmarks/x.py ...``."""
    import shlex
    import sys
    from pathlib import Path

    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).is_file():
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(Path(__file__).resolve().parents[1]))
        except ValueError:
            pass
    return "python " + shlex.join(argv)


def header(argv=None) -> dict:
    """The run's record: ``commit``, ``command``, ``date`` (UTC) and ``machine()``."""
    import datetime

    return {
        "commit": commit(),
        "command": command(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
    }


def header_line(info: dict | None = None) -> str:
    """One line for the top of a run's output (and of its results file)."""
    info = info or header()
    m = info["machine"]
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores"
    load = f", load {m['load']}" if m.get("load") is not None else ""
    return (
        f"Run at commit {info['commit']} on {info['date']}: `{info['command']}` "
        f"({m['os']}, {where}{load}; MLX {m['mlx']} on {m['device']}, mlx-lm {m['mlx-lm']})"
    )


def print_header(info: dict | None = None) -> dict:
    """Print ``header_line`` and return the record (for ``dump_json``)."""
    info = info or header()
    print(header_line(info), flush=True)
    return info


class Timing:
    """Times of repeated runs and the statistic a table reports (the median)."""

    def __init__(self, times, warmup: int):
        import statistics

        self.times, self.warmup = list(times), warmup
        self.median = statistics.median(self.times)
        self.min, self.max = min(self.times), max(self.times)

    @property
    def statistic(self) -> str:
        return f"median of {len(self.times)} after {self.warmup} warm-up"

    def as_dict(self) -> dict:
        return {
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "n": len(self.times),
            "warmup": self.warmup,
            "statistic": self.statistic,
        }


def same_tokens(ours, stock) -> str:
    """``yes`` where every output's tokens equal stock's, else ``NO`` with
    how many outputs differ and the first token where each does (bfloat16
    verify forwards round differently from one-token steps: a near-tie can
    flip, and the text goes its own way from there)."""
    outs = [(list(o), list(s)) for o, s in zip(ours, stock, strict=True)]
    at = [
        next((i for i, (x, y) in enumerate(zip(o, s, strict=False)) if x != y), min(len(o), len(s)))
        for o, s in outs
        if o != s
    ]
    if not at:
        return "yes"
    return f"NO ({len(at)}/{len(outs)} differ, from token {', '.join(map(str, at))})"


def timed(fn, *args, repeats: int = 5, warmup: int = 1, clock=None):
    """``(Timing, last result)`` of ``fn(*args)`` run ``warmup + repeats`` times.

    ``fn`` must finish its work before it returns (``mx.eval`` what it
    computes). ``clock`` defaults to ``time.perf_counter``; pass
    ``time.process_time`` on a shared machine to count this process's CPU.
    """
    import time

    clock = clock or time.perf_counter
    times, out = [], None
    for i in range(warmup + repeats):
        tic = clock()
        out = fn(*args)
        if i >= warmup:
            times.append(clock() - tic)
    return Timing(times, warmup), out


def table(columns, rows) -> str:
    """A markdown table: ``columns`` names, ``rows`` sequences of cells (str() each)."""
    lines = ["| " + " | ".join(str(c) for c in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def figures_block(name: str, columns, rows, note: str = "") -> str:
    """A results file's fenced ``json figures`` block: the table a README shows.

    ``benchmarks/readme_tables.py`` renders it between the README's
    ``<!-- figures: NAME -->`` and ``<!-- /figures -->`` markers.
    """
    import json

    def dumps(x):
        return json.dumps(x, ensure_ascii=False)

    lines = [f' "name": {dumps(name)},', f' "columns": {dumps([str(c) for c in columns])},']
    if note:
        lines.append(f' "note": {dumps(note)},')
    body = ",\n".join("  " + dumps([str(c) for c in r]) for r in rows)
    lines.append(' "rows": [\n' + body + "\n ]")
    return "```json figures\n{\n" + "\n".join(lines) + "\n}\n```"


def dump_json(path, data, info: dict | None = None) -> None:
    """Write ``{"header": info, **data}`` to ``path`` (a folder is made)."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def plain(x):  # numpy and MLX scalars as numbers, anything else as text
        try:
            return float(x)
        except (TypeError, ValueError):
            return str(x)

    text = json.dumps({"header": info or header(), **data}, indent=1, default=plain)
    path.write_text(text + "\n")


def grad_cost(fn, args, repeats: int = 3, warmup: int = 1, compiled: bool = False):
    """``(Timing, peak bytes, loss)`` of loss + gradient: ``mx.value_and_grad(fn)(*args)``.

    The one "loss + gradient: time and peak memory" loop of the benchmarks.
    Each call starts from a cleared cache; its peak is ``mx.get_peak_memory()``
    above the memory held before it (the inputs), the most over the timed
    calls. ``compiled``: under ``mx.compile``, as ``mlx_lm.lora`` runs its
    step (the first call compiles, so at least one warm-up).
    """
    import gc
    import time

    import mlx.core as mx

    vg = mx.value_and_grad(fn)
    if compiled:
        vg, warmup = mx.compile(vg), max(warmup, 1)
    mx.eval(args)
    mx.synchronize()
    times, peak, value = [], 0, None
    for i in range(warmup + repeats):
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        loss, grad = vg(*args)
        mx.eval(loss, grad)
        mx.synchronize()
        dt = time.perf_counter() - tic
        if i >= warmup:
            times.append(dt)
            peak = max(peak, mx.get_peak_memory() - base)
        value = loss.item()
        del loss, grad
    return Timing(times, warmup), peak, value
