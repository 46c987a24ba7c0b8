"""The measuring choice among the flash-cce paths: time the candidates once, keep the fastest that fits.

``selection.select`` calls ``choose`` for a call whose request leaves the
path open (``impl`` ``auto`` or ``flash`` with ``backend="auto"``), with the
paths that can run it here. On the first call of a shape bucket (the first
training batch), each candidate runs loss + hidden-state gradient once on
inputs of the call's shapes, dtype and head kind, on its device, and the
fastest whose peak working memory fits the memory budget wins. Candidates:

- ``stock``: mlx-lm's full-logit loss, where the request allows it and its
  logits fit the budget (on a GPU with room for it, a dense head is also
  timed over budget as the reference the log line compares with; never for
  a quantized head on the CPU, where MLX's quantized matmul is much slower
  than the pure-MLX path's BLAS blocks). Timed uncompiled: it needs no
  kernel compile that way;
- ``mlx``: the pure-MLX path in small blocks (the CPU's path: the CPU
  allocates only a few operations ahead); on a GPU a last resort;
- ``mlx-blocks`` (GPU): the pure-MLX one-pass step in big blocks under MLX's
  backpressure (``budget.bounded``); on CUDA in the first blocks only, as a
  fallback for ``cuda-gemm``;
- ``cuda-gemm`` (CUDA GPU): the same blocks with its CUDA row kernel;
- ``cuda`` fused kernels: the least memory and the slowest, so tried only
  when nothing else fits (their compile time would otherwise dominate).

One log line says what was tried and what won, or why one candidate was
left (each other path with its reason: over the budget, not asked for, not
timed). The choice is kept in memory and on disk
(``cache_root()/flash-cce/autotune.json``: the user cache dir or
``$MLX_LM_EXT_CACHE``; ``$MLX_LM_FLASH_CCE_CACHE`` names another folder)
per (request, device, MLX version, shape bucket, dtype, head kind, budget):
an ``auto`` call never reuses what a ``flash``-only call decided. An entry
written by another MLX version or device is ignored. A candidate that fails
(out of memory, a kernel that does not build) is dropped with a debug line.

Data-parallel runs (``mx.distributed``): rank 0 decides (its cache or its
trial) on the first call and every rank takes rank 0's choice through one
``all_sum``; that choice holds for the whole run, so the ranks never run
different paths (see ``choose``).
"""

import gc
import json
import logging
import os
import pathlib
import time
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import budget as _budget
from . import heads as _heads
from . import portable as _portable
from . import ranks
from .candidate import GPU_BLOCKS, MIB, Candidate, Choice, Path, Result  # noqa: F401 (re-exported)
from .paths import CACHE_ENV, cache_dir  # noqa: F401 (re-exported)

log = logging.getLogger("mlx_lm_flash_cce")

CACHE_VERSION = 2  # 2: candidates name a Path, keys name the request
REQUESTS = ("auto", "flash")  # what choose decides among: every path, or the flash paths


def device_name() -> str:
    dev = mx.default_device()
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 (older MLX without device_info)
        name = ""
    return f"{'gpu' if dev == mx.gpu else 'cpu'}:{name}"


def head_kind(spec: _heads.Head) -> str:
    if spec.kind == "quantized":
        return f"q{spec.bits}-{spec.mode}-g{spec.group_size}"
    return spec.kind


def bucket(n_tokens: int) -> int:
    """Tokens rounded up to a power of two: batches of similar length share a choice."""
    return 1 << max(0, (n_tokens - 1).bit_length())


def cache_path() -> pathlib.Path:
    return cache_dir() / "autotune.json"


def _key(spec, n, h, dtype, nbytes, opts, request="auto") -> str:
    extra = ""
    if opts.softcap is not None or opts.logit_scale is not None:
        extra = f"|cap{opts.softcap}|scale{opts.logit_scale}"
    return (
        f"{request}|N{bucket(n)}|V{spec.vocab}|H{h}|{_dtype(dtype)}|{head_kind(spec)}"
        f"|budget{nbytes}{extra}"
    )


def _dtype(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _load_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else {}


def _save_cache(key: str, choice: Choice) -> None:
    entry = {
        "candidate": choice.candidate.as_dict(),
        "ms": choice.ms,
        "peak": choice.peak,
        "line": choice.line,
        "mlx": mx.__version__,
        "device": device_name(),
    }
    path = cache_path()
    try:
        data = _load_cache() or {"version": CACHE_VERSION}
        data.setdefault("choices", {})[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a trial next time, nothing else
        log.debug("flash-cce auto: cannot write %s: %s", path, e)


def _cached(key: str) -> Optional[Choice]:
    entry = _load_cache().get("choices", {}).get(key)
    if not entry:
        return None
    if entry.get("mlx") != mx.__version__ or entry.get("device") != device_name():
        log.debug(
            "flash-cce auto: cached choice for %s is from mlx %s on %s; measuring again",
            key,
            entry.get("mlx"),
            entry.get("device"),
        )
        return None
    try:
        fields = dict(entry["candidate"])
        cand = Candidate(**dict(fields, path=Path(fields["path"])))
    except (TypeError, KeyError, ValueError):
        return None
    return Choice(cand, entry.get("ms", 0.0), entry.get("peak", 0), entry.get("line", ""))


# ------------------------------------------------------------- candidates


def stock_bytes(n: int, vocab: int, dtype: mx.Dtype) -> int:
    """The stock loss's working memory per logit, as measured (flash-cce-h200.md, flash-cce-cpu.md)."""
    return n * vocab * (16 if dtype.size >= 4 else 4)


def floor_bytes(cand: Candidate, n: int, h: int, dtype: mx.Dtype) -> int:
    """A lower bound on a flash candidate's working memory (accumulators, outputs, blocks)."""
    if cand.path is Path.STOCK:
        return 0  # stock_bytes is checked separately
    acc = n * h * (4 + dtype.size)
    if cand.vocab_chunk:
        # Blocks alive at once, as measured on the H200 (flash-cce-h200.md):
        # the MLX step two (the logits and P), the row kernel four (its
        # output and the backward's recomputed block overlap the next
        # matmul). A candidate that cannot fit is never tried, which spares
        # the trial its kernel compiles.
        blocks = 4 if cand.path is Path.CUDA_GEMM else 2
        return acc + blocks * cand.token_chunk * cand.vocab_chunk * dtype.size
    return acc


def candidates(
    spec: _heads.Head, n: int, include_stock: bool, runnable: Sequence[Path] = (Path.MLX,)
) -> List[Candidate]:
    """The trial's candidates for a call that ``runnable`` paths can run, fastest first."""
    out = [Candidate(Path.STOCK)] if include_stock else []
    if not _budget.is_async_gpu():
        return out + [Candidate(Path.MLX)]
    seen = set()
    # Fastest first, so that the trial can skip what a fitting result dominates:
    # big blocks first, the row kernel before the MLX step (on CUDA the MLX
    # step in the first blocks only).
    for i, (tc, vc, limit) in enumerate(GPU_BLOCKS):
        for path in (Path.CUDA_GEMM, Path.MLX_BLOCKS):
            if path not in runnable or (
                path is Path.MLX_BLOCKS and Path.CUDA_GEMM in runnable and i
            ):
                continue
            tc, vc = min(tc, n), min(vc, spec.vocab)
            if (path, tc, vc) not in seen:
                seen.add((path, tc, vc))
                out.append(Candidate(path, tc, vc, limit))
    if Path.CUDA in runnable:
        out.append(Candidate(Path.CUDA, last_resort=True))
    # The CPU's small blocks: launch-bound on a GPU, but the least memory.
    out.append(Candidate(Path.MLX, 256, 1024, last_resort=True))
    return out


# ----------------------------------------------------------------- trial


def _synthetic(spec, n, h, dtype, seed=0):
    """Inputs of the call's shapes, dtype and head kind (the real ones may be tracers)."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(dtype)
    targets = mx.random.randint(0, spec.vocab, (n,), key=k3)
    w = mx.random.normal((spec.vocab, h), key=k2) * h**-0.5
    if spec.kind == "quantized":
        # Scales of the real head's dtype: float32 ones would make every
        # dequantized block float32 and the measured peak that of another head.
        w = w.astype(spec.scales.dtype)
        parts = mx.quantize(w, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
        head = spec._replace(
            weight=parts[0],
            scales=parts[1],
            biases=parts[2] if len(parts) > 2 else None,
            bias=None,
            lora_a=None,
            lora_b=None,
            module=None,
        )
    else:
        head = spec._replace(
            weight=w.astype(spec.weight.dtype), bias=None, lora_a=None, lora_b=None, module=None
        )
    mx.eval(hidden, targets, _heads.head_arrays(head)[1])
    return hidden, head, targets


def _measure(run, cand, hidden) -> Result:
    """Milliseconds and peak bytes above the inputs of loss + hidden gradient.

    Compiled, as ``mlx_lm.lora`` compiles its training step: under
    ``mx.grad`` alone MLX runs a compiled block step op by op (measured
    slower, flash-cce-h200.md's compile probe), so an uncompiled trial
    would rank the paths as training never runs them (the stock head
    excepted, see below). The first call compiles and is not timed.
    """
    grad = mx.value_and_grad(lambda x: run(cand, x).sum())
    if cand.path is not Path.STOCK:
        # The stock head is two GEMMs and a logsumexp, the same kernels
        # compiled or not (flash-cce-h200.md), and uncompiled it costs no
        # NVRTC compile on a first run.
        grad = mx.compile(grad)
    # The last candidate's buffers go; the timed call reuses this one's, as a step does.
    mx.clear_cache()
    with _budget.bounded(cand.limit_mib * MIB):
        for _ in range(2):  # the compiling call, then the timed one
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            out = grad(hidden)
            mx.eval(out)
            mx.synchronize()
            dt = time.perf_counter() - tic
            peak = mx.get_peak_memory() - base
            del out
            log.debug("flash-cce auto: %s call %.3f s", cand.label, dt)
    return Result(cand, 1e3 * dt, peak)


def trial(
    cands: List[Candidate],
    spec: _heads.Head,
    n: int,
    h: int,
    dtype: mx.Dtype,
    nbytes: int,
    run_choice: Callable[..., mx.array],
) -> Tuple[List[Result], List[Candidate]]:
    """Time each candidate; return ``(results, failed)`` (results in trial order)."""
    hidden, head, targets = _synthetic(spec, n, h, dtype)
    results, failed = [], []

    def run(cand, x):
        return run_choice(cand, head, x, targets)

    for cand in [c for c in cands if not c.last_resort]:
        beaten = [r for r in results if r and r.peak <= nbytes and dominates(r.candidate, cand)]
        if beaten:
            log.debug("flash-cce auto: %s skipped (%s fits)", cand.label, beaten[0].candidate.label)
            continue
        results.append(_try(run, cand, hidden, failed))
    if not any(r and r.peak <= nbytes for r in results):
        for cand in [c for c in cands if c.last_resort]:
            results.append(_try(run, cand, hidden, failed))
            if results[-1] and results[-1].peak <= nbytes:
                break
    gc.collect()
    mx.clear_cache()
    return [r for r in results if r], failed


def dominates(a: Candidate, b: Candidate) -> bool:
    """Can ``b`` be no faster than ``a`` (so a fitting ``a`` spares its trial)?

    By construction: both run the one-pass big-block structure with the same
    GEMMs; ``b``'s blocks are no bigger (as many launches or more) and its
    memory limit no higher (as little run-ahead or less), and its
    elementwise step is the same or the unfused MLX one where ``a`` has the
    row kernel. By measurement (flash-cce-h200.md): blocks of a sixteenth
    the size or less (sixteen times the launches) are slower whatever their step.
    """
    big = (Path.CUDA_GEMM, Path.MLX_BLOCKS)
    if a.path not in big or b.path not in big or not a.vocab_chunk or not b.vocab_chunk:
        return False
    if 16 * b.token_chunk * b.vocab_chunk <= a.token_chunk * a.vocab_chunk:
        return True
    return (
        (a.path is Path.CUDA_GEMM or b.path is Path.MLX_BLOCKS)
        and b.token_chunk <= a.token_chunk
        and b.vocab_chunk <= a.vocab_chunk
        and b.limit_mib <= a.limit_mib
    )


def _try(run, cand, hidden, failed) -> Optional[Result]:
    try:
        return _measure(run, cand, hidden)
    except Exception as e:  # noqa: BLE001 (out of memory, a kernel that fails to build: drop it)
        log.debug(
            "flash-cce auto: %s failed in the trial (%s: %s); dropped",
            cand.label,
            type(e).__name__,
            e,
        )
        failed.append(cand)
        gc.collect()
        mx.clear_cache()
        return None


# ---------------------------------------------------------------- choice

_MEMORY = {}  # key -> Choice, this process


def _stock_reference(spec, n, dtype) -> bool:
    """Time the stock head as the reference even over budget? On a GPU with room for it.

    Not for a quantized head: MLX's quantized matmul was slower than every
    flash path on the H200 and compiles its kernels for a long time on a
    first run (flash-cce-h200.md), a cost no reference is worth.
    """
    if not _budget.is_async_gpu() or spec.kind == "quantized":
        return False
    return 0 < stock_bytes(n, spec.vocab, dtype) <= _budget.device_floor() // 3


def _stock_verdict(spec, n, dtype, nbytes, include_stock) -> Tuple[bool, bool, Optional[str]]:
    """``(stock within the shortlist, stock timed as a reference, why it is out)``."""
    need = stock_bytes(n, spec.vocab, dtype)
    if not include_stock:
        return False, False, "stock: not asked for (flash paths only)"
    if need > nbytes:
        return False, _stock_reference(spec, n, dtype), f"stock: needs ~{_budget.format_size(need)}"
    if spec.kind == "quantized" and not _budget.is_async_gpu():
        # MLX's CPU quantized_matmul is much slower than the dequantized BLAS
        # blocks the pure-MLX path uses: timing it would cost more than it tells.
        return False, False, "stock: not timed (MLX's quantized matmul is slow on the CPU)"
    return True, False, None


def shortlist(
    spec, n, h, dtype, nbytes, include_stock, runnable
) -> Tuple[List[Candidate], List[Candidate], List[str]]:
    """``(candidates to time, those within the budget, why each other path is out)``."""
    fits, reference, why_stock = _stock_verdict(spec, n, dtype, nbytes, include_stock)
    cands = candidates(spec, n, fits or reference, runnable)
    within, out = [], [why_stock] if why_stock else []
    for c in cands:
        if c.path is Path.STOCK:
            continue
        need = floor_bytes(c, n, h, dtype)
        if need <= nbytes:
            within.append(c)
        else:
            out.append(f"{c.label}: needs at least {_budget.format_size(need)}")
    if fits:
        within.insert(0, Candidate(Path.STOCK))
    return cands, within, out


def _what(spec, n, h, dtype, include_stock) -> str:
    who = "flash-cce auto" if include_stock else "flash-cce auto (flash paths only)"
    return f"{who}: [{n} tokens, V={spec.vocab}, H={h}, {_dtype(dtype)}, {head_kind(spec)} head]"


def _only_line(what, only, out, nbytes) -> str:
    """The line for a choice without a trial, with each other path's true reason."""
    size = _budget.format_size(nbytes)
    if all(": needs " in reason for reason in out):
        where = f"the only path within the budget {size}"
    else:
        where = f"the only path left (budget {size})"
    return f"{what}: {only.label} ({'; '.join([where] + out)}; no trial)"


def _over_budget(what, nbytes, smallest, label="") -> Exception:
    from mlx_lm_ext.api import PluginError

    measured = " measured" if label else ""
    return PluginError(
        f"--cce-memory-budget {_budget.format_size(nbytes)} is below what any flash-cce path "
        f"needs for a batch of {what.split(': ', 1)[1]}: the smallest{measured} is "
        f"{_budget.format_size(smallest)}{f' ({label})' if label else ''}"
    )


def decide(
    spec: _heads.Head,
    n: int,
    h: int,
    dtype: mx.Dtype,
    nbytes: int,
    run_choice: Callable[..., mx.array],
    include_stock: bool,
    strict: bool = True,
    runnable: Sequence[Path] = (Path.MLX,),
) -> Choice:
    """This process's choice: the only candidate left, or a trial's winner.

    ``strict``: the user set the budget, and a batch no path fits is an
    error; the default budget takes the path of least memory instead.
    """
    what = _what(spec, n, h, dtype, include_stock)
    cands, within, out = shortlist(spec, n, h, dtype, nbytes, include_stock, runnable)
    flash = [c for c in cands if c.path is not Path.STOCK]
    if not within and not strict:
        within = [min(flash, key=lambda c: floor_bytes(c, n, h, dtype))]
    if not within:
        raise _over_budget(what, nbytes, min(floor_bytes(c, n, h, dtype) for c in flash))
    if len(within) == 1 and not any(c.path is Path.STOCK for c in cands):
        return Choice(within[0], 0.0, 0, _only_line(what, within[0], out, nbytes))
    timed = [c for c in cands if c.path is Path.STOCK or c in within]
    return _trial_choice(timed, spec, n, h, dtype, nbytes, run_choice, strict, what)


def _trial_choice(cands, spec, n, h, dtype, nbytes, run_choice, strict, what) -> Choice:
    """The fastest measured candidate within the budget, and the line that says so."""
    tic = time.perf_counter()
    results, failed = trial(cands, spec, n, h, dtype, nbytes, run_choice)
    spent = time.perf_counter() - tic
    fit = [r for r in results if r.peak <= nbytes]
    if not fit and results and not strict:
        fit = [min(results, key=lambda r: r.peak)]
    if not fit and not results:  # every candidate failed: the path that runs every call
        cand = Candidate(Path.MLX)
        log.warning(
            "flash-cce auto: every candidate failed in the trial (%s); using %s",
            ", ".join(c.label for c in failed),
            cand.label,
        )
        return Choice(cand, 0.0, 0, "")
    if not fit:
        best = min(results, key=lambda r: r.peak)
        raise _over_budget(what, nbytes, best.peak, best.candidate.label)
    win = min(fit, key=lambda r: r.ms)
    return Choice(
        win.candidate, win.ms, win.peak, _trial_line(what, nbytes, results, failed, win, spent)
    )


def _trial_line(what, nbytes, results, failed, win, spent) -> str:
    stock = next((r for r in results if r.candidate.path is Path.STOCK), None)
    tried = ", ".join(
        f"{r.candidate.label} {r.ms:.1f} ms/{r.peak / MIB:.0f} MiB"
        + (" (over budget)" if r.peak > nbytes else "")
        for r in results
    )
    tried += "".join(f", {c.label} failed" for c in failed)
    line = (
        f"{what}, budget {_budget.format_size(nbytes)}: tried {tried}; "
        f"chose {win.candidate.label} ({win.ms:.1f} ms, {win.peak / MIB:.0f} MiB"
    )
    if stock is not None and win.candidate.path is not Path.STOCK:
        line += f", {win.ms / stock.ms:.2f}x stock's time"
    line += f"); trial {spent:.1f} s"
    if stock is not None and stock.peak > nbytes and win.ms > 1.5 * stock.ms:
        line += (
            f"; nothing within the budget is within 1.5x of stock's {stock.ms:.1f} ms "
            "(a larger --cce-memory-budget buys speed)"
        )
    return line


_DP = []  # the one choice of a data-parallel run


def _rank0_choice(key, cands, decide_now) -> Choice:
    """Rank 0's (or a lone process's) choice: its cache, else ``decide_now()`` (saved)."""
    choice = _cached(key)
    if choice is not None and choice.candidate not in cands + [Candidate(Path.MLX)]:
        choice = None  # written by a version with other candidates
    if choice is not None:
        log.info(
            "%s (cached)",
            choice.line.split("; trial")[0] if choice.line else choice.candidate.label,
        )
        return choice
    choice = decide_now()
    if choice.line:
        log.info(choice.line)
        _save_cache(key, choice)
    return choice


def choose(
    spec: _heads.Head,
    n: int,
    h: int,
    dtype: mx.Dtype,
    nbytes: Optional[int],
    opts: _portable.Options,
    run_choice: Callable[..., mx.array],
    include_stock: bool = True,
    runnable: Sequence[Path] = (Path.MLX,),
) -> Candidate:
    """The path for this call: cached, or measured now (``selection.select`` is the caller).

    ``include_stock``: the request allows the stock head (``impl="auto"``)
    or only flash paths (``impl="flash"``): each has its own cache entries.
    ``runnable``: the flash paths that can run this call here. ``nbytes``:
    the memory budget (None: ``budget.default_for`` the batch).
    Data-parallel runs decide once, on the first call (which every rank
    makes in step: the first validation batch or the first training step),
    and keep rank 0's choice for every later shape: ranks pad their batches
    to their own lengths and mlx-lm's compiled step retraces on each rank's
    own schedule, so a collective per shape could pair up calls of
    different shapes, or wait forever.
    """
    from mlx_lm_ext.api import PluginError

    strict = nbytes is not None
    if nbytes is None:
        nbytes = _budget.default_for(stock_bytes(n, spec.vocab, dtype))
    request = REQUESTS[0] if include_stock else REQUESTS[1]
    key = _key(spec, n, h, dtype, nbytes, opts, request)
    if key in _MEMORY:
        return _MEMORY[key].candidate
    group = ranks.group()
    if group is not None and _DP:
        return _DP[0]
    choice, error = None, None
    if ranks.rank() == 0:

        def decide_now():
            return decide(spec, n, h, dtype, nbytes, run_choice, include_stock, strict, runnable)

        try:
            choice = _rank0_choice(key, candidates(spec, n, include_stock, runnable), decide_now)
        except PluginError as e:
            error = e
    if group is not None:
        agreed = ranks.agree(group, choice.candidate if choice is not None else None)
        if agreed is None:
            raise error or PluginError(
                "flash-cce auto: rank 0 found no path within the memory budget"
            )
        _DP.append(agreed)
        choice = Choice(agreed, 0.0, 0, "")
    elif error is not None:
        raise error
    _MEMORY[key] = choice
    return choice.candidate
