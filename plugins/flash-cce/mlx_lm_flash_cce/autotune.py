"""``backend="auto"``: measure the candidate paths once, keep the fastest that fits.

On the first call of a shape bucket (the first training batch), each
candidate path runs loss + hidden-state gradient once on inputs of the
call's shapes, dtype and head kind, on its device, and the fastest whose
peak working memory fits the memory budget wins. Candidates:

- ``stock``: mlx-lm's full-logit loss, where its logits fit the budget (on
  a GPU with room for it, a dense head is also timed over budget as the
  reference the log line compares with; never for a quantized head on the
  CPU, where MLX's quantized matmul is ~10x slower than the pure-MLX path's
  BLAS blocks). Timed uncompiled: it needs no kernel compile that way;
- ``mlx``: the pure-MLX path; on a GPU in big blocks with the one-pass
  step and MLX's backpressure (``budget.bounded``), on the CPU in today's
  small blocks (the CPU allocates only a few operations ahead);
- ``cuda-gemm`` (CUDA GPU): the same blocks with its CUDA row kernel (there
  the pure-MLX path is tried in big blocks only, as a fallback);
- ``cuda`` fused kernels and the pure-MLX path in small blocks: the least
  memory and the slowest, so they are tried only when nothing else fits
  (their compile time would otherwise dominate the trial).

One log line says what was tried and what won. The choice is kept in
memory and on disk (``cache_root()/flash-cce/autotune.json``: the user
cache dir or ``$MLX_LM_EXT_CACHE``; ``$MLX_LM_FLASH_CCE_CACHE`` names
another folder) per (device, MLX version, shape
bucket, dtype, head kind, budget); an entry written by another MLX version
or device is ignored. A candidate that fails (out of memory, a kernel
that does not build) is dropped with a debug log line.

Data-parallel runs (``mx.distributed``): rank 0 decides (its cache or its
trial) on the first call and every rank takes rank 0's choice through one
``all_sum``; that choice holds for the whole run, so the ranks never run
different paths (see ``choose``).
"""

import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from . import budget as _budget
from . import heads as _heads
from . import portable as _portable
from . import ranks
from .candidate import GPU_BLOCKS, MIB, Candidate, Choice, Result  # noqa: F401 (re-exported)
from .paths import CACHE_ENV, cache_dir  # noqa: F401 (re-exported)

log = logging.getLogger("mlx_lm_flash_cce")

CACHE_VERSION = 1


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


def cache_path() -> Path:
    return cache_dir() / "autotune.json"


def _key(spec, n, h, dtype, nbytes, opts) -> str:
    extra = ""
    if opts.softcap is not None or opts.logit_scale is not None:
        extra = f"|cap{opts.softcap}|scale{opts.logit_scale}"
    return (
        f"N{bucket(n)}|V{spec.vocab}|H{h}|{_dtype(dtype)}|{head_kind(spec)}|budget{nbytes}{extra}"
    )


def _dtype(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _load_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else {}


def _save_cache(key: str, entry: dict) -> None:
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
        cand = Candidate(**entry["candidate"])
    except (TypeError, KeyError):
        return None
    return Choice(cand, entry.get("ms", 0.0), entry.get("peak", 0), entry.get("line", ""))


# ------------------------------------------------------------- candidates


def stock_bytes(n: int, vocab: int, dtype: mx.Dtype) -> int:
    """The stock loss's working memory: measured ~4 bytes a logit in bf16, 16 in float32."""
    return n * vocab * (16 if dtype.size >= 4 else 4)


def floor_bytes(cand: Candidate, n: int, h: int, dtype: mx.Dtype) -> int:
    """A lower bound on a candidate's working memory (accumulators, outputs, two blocks)."""
    if cand.impl == "stock":
        return 0  # stock_bytes is checked separately
    acc = n * h * (4 + dtype.size)
    if cand.vocab_chunk:
        # Blocks alive at once, measured on the H200 (bf16, 8192 x 32768): the
        # MLX step two (the logits and P; 1152 MiB with the accumulators), the
        # row kernel four (its output and the backward's recomputed block
        # overlap the next matmul; 2144 MiB). A candidate that cannot fit is
        # never tried, which spares the trial its kernel compiles.
        blocks = 4 if cand.backend == "cuda-gemm" else 2
        return acc + blocks * cand.token_chunk * cand.vocab_chunk * dtype.size
    return acc


def candidates(spec: _heads.Head, n: int, h: int, dtype: mx.Dtype, include_stock: bool) -> list:
    from . import backends, cuda

    out = [Candidate("stock")] if include_stock else []
    if not _budget.is_async_gpu():
        return out + [Candidate("flash", "mlx")]
    plain = spec.bias is None and not spec.has_lora
    here = backends.available()
    seen = set()
    on_cuda = cuda.available()
    # Fastest first, so that the trial can skip what a fitting result dominates:
    # big blocks first, the row kernel before the MLX step (big blocks only on CUDA).
    for i, (tc, vc, limit) in enumerate(GPU_BLOCKS):
        for backend in ("cuda-gemm", "mlx"):
            if backend not in here or not plain or (backend == "cuda-gemm" and not on_cuda):
                continue
            if backend == "mlx" and on_cuda and i > 0:
                continue
            tc, vc = min(tc, n), min(vc, spec.vocab)
            if (backend, tc, vc) not in seen:
                seen.add((backend, tc, vc))
                out.append(Candidate("flash", backend, tc, vc, limit))
    if "cuda" in here and plain:
        out.append(Candidate("flash", "cuda", last_resort=True))
    # The CPU's small blocks: launch-bound on a GPU, but the least memory.
    out.append(Candidate("flash", "mlx", 256, 1024, last_resort=plain))
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
    ``mx.grad`` alone MLX runs a compiled block step op by op (the pure-MLX
    path took 30 ms instead of 20 on the H200), so an uncompiled trial
    would rank the paths as training never runs them (the stock head
    excepted, see below). The first call compiles and is not timed.
    """
    grad = mx.value_and_grad(lambda x: run(cand, x).sum())
    if cand.impl != "stock":
        # The stock head is two GEMMs and a logsumexp, the same kernels
        # compiled or not (18.0 and 17.7 ms on the H200), and uncompiled it
        # costs no NVRTC compile: 0.3 s instead of 7.3 s on a first run.
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
    row kernel. By measurement: blocks of a sixteenth the size or less (16x
    the launches) are slower whatever their step (on the H200 the row kernel
    in 2048 x 8192 took 1.37-1.45x the MLX step's time in 8192 x 32768).
    """
    if a.impl != "flash" or b.impl != "flash" or not a.vocab_chunk or not b.vocab_chunk:
        return False
    if 16 * b.token_chunk * b.vocab_chunk <= a.token_chunk * a.vocab_chunk:
        return True
    steps = {("cuda-gemm", "cuda-gemm"), ("cuda-gemm", "mlx"), ("mlx", "mlx")}
    return (
        (a.backend, b.backend) in steps
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

    Not for a quantized head: MLX's quantized matmul was 3.3-3.9x slower
    than every flash path on the H200, and a first run compiles its
    kernels for ~56 s, a cost no reference is worth.
    """
    if not _budget.is_async_gpu() or spec.kind == "quantized":
        return False
    return 0 < stock_bytes(n, spec.vocab, dtype) <= _budget.device_floor() // 3


def decide(
    spec: _heads.Head,
    n: int,
    h: int,
    dtype: mx.Dtype,
    nbytes: int,
    opts: _portable.Options,
    run_choice: Callable[..., mx.array],
    include_stock: bool,
    strict: bool = True,
) -> Choice:
    """This process's choice: the only candidate that fits, or a trial's winner.

    ``strict``: the user set the budget, and a batch no path fits is an
    error; the default budget takes the path of least memory instead.
    """
    from mlx_lm_ext import PluginError

    why_not = f"the stock head needs ~{_budget.format_size(stock_bytes(n, spec.vocab, dtype))}"
    if spec.kind == "quantized" and not _budget.is_async_gpu() and include_stock:
        # MLX's CPU quantized_matmul is ~10x slower than the dequantized BLAS
        # blocks the pure-MLX path uses: timing it would cost more than it tells.
        include_stock = False
        why_not = "MLX's quantized matmul is slow on the CPU, so the stock head is not timed"
    fits_stock = include_stock and stock_bytes(n, spec.vocab, dtype) <= nbytes
    cands = candidates(
        spec, n, h, dtype, fits_stock or (include_stock and _stock_reference(spec, n, dtype))
    )
    within = [c for c in cands if c.impl != "stock" and floor_bytes(c, n, h, dtype) <= nbytes]
    if fits_stock:
        within.insert(0, Candidate("stock"))
    what = f"[{n} tokens, V={spec.vocab}, H={h}, {_dtype(dtype)}, {head_kind(spec)} head]"
    if not within and not strict:
        within = [
            min((c for c in cands if c.impl != "stock"), key=lambda c: floor_bytes(c, n, h, dtype))
        ]
    if not within:
        smallest = min(floor_bytes(c, n, h, dtype) for c in cands if c.impl != "stock")
        raise PluginError(
            f"--cce-memory-budget {_budget.format_size(nbytes)} is below what any flash-cce path "
            f"needs for a batch of {what}: the smallest is {_budget.format_size(smallest)}"
        )
    if len(within) == 1 and not any(c.impl == "stock" for c in cands):
        only = within[0]
        line = (
            f"flash-cce auto: {what}: {only.label} (the only path within the budget "
            f"{_budget.format_size(nbytes)}; {why_not}; no trial)"
        )
        return Choice(only, 0.0, 0, line)
    tic = time.perf_counter()
    results, failed = trial(
        [c for c in cands if c.impl == "stock" or c in within],
        spec,
        n,
        h,
        dtype,
        nbytes,
        run_choice,
    )
    spent = time.perf_counter() - tic
    fit = [r for r in results if r.peak <= nbytes]
    if not fit and results and not strict:
        fit = [min(results, key=lambda r: r.peak)]
    if not fit:
        if not results:  # every candidate failed: the default path, as without a trial
            cand = Candidate("flash", "mlx")
            log.warning(
                "flash-cce auto: every candidate failed in the trial (%s); using %s",
                ", ".join(c.label for c in failed),
                cand.label,
            )
            return Choice(cand, 0.0, 0, "")
        best = min(results, key=lambda r: r.peak)
        raise PluginError(
            f"--cce-memory-budget {_budget.format_size(nbytes)} is below what any flash-cce path "
            f"needs for a batch of {what}: the smallest measured is "
            f"{_budget.format_size(best.peak)} ({best.candidate.label})"
        )
    win = min(fit, key=lambda r: r.ms)
    stock = next((r for r in results if r.candidate.impl == "stock"), None)
    tried = ", ".join(
        f"{r.candidate.label} {r.ms:.1f} ms/{r.peak / MIB:.0f} MiB"
        + (" (over budget)" if r.peak > nbytes else "")
        for r in results
    )
    tried += "".join(f", {c.label} failed" for c in failed)
    line = (
        f"flash-cce auto: {what}, budget {_budget.format_size(nbytes)}: tried {tried}; "
        f"chose {win.candidate.label} ({win.ms:.1f} ms, {win.peak / MIB:.0f} MiB"
    )
    if stock is not None and win.candidate.impl != "stock":
        line += f", {win.ms / stock.ms:.2f}x stock's time"
    line += f"); trial {spent:.1f} s"
    if stock is not None and stock.peak > nbytes and win.ms > 1.5 * stock.ms:
        line += (
            f"; nothing within the budget is within 1.5x of stock's {stock.ms:.1f} ms "
            "(a larger --cce-memory-budget buys speed)"
        )
    return Choice(win.candidate, win.ms, win.peak, line)


_DP = []  # the one choice of a data-parallel run


def choose(
    spec: _heads.Head,
    n: int,
    h: int,
    dtype: mx.Dtype,
    nbytes: Optional[int],
    opts: _portable.Options,
    run_choice: Callable[..., mx.array],
    include_stock: bool = True,
) -> Candidate:
    """The path for this call: cached, or measured now.

    ``nbytes``: the memory budget (None: ``budget.default_for`` the batch).
    Data-parallel runs decide once, on the first call (which every rank
    makes in step: the first validation batch or the first training step),
    and keep rank 0's choice for every later shape: ranks pad their batches
    to their own lengths and mlx-lm's compiled step retraces on each rank's
    own schedule, so a collective per shape could pair up calls of
    different shapes, or wait forever.
    """
    from mlx_lm_ext import PluginError

    strict = nbytes is not None
    if nbytes is None:
        nbytes = _budget.default_for(stock_bytes(n, spec.vocab, dtype))
    key = _key(spec, n, h, dtype, nbytes, opts)
    if key in _MEMORY:
        return _MEMORY[key].candidate
    group = ranks.group()
    if group is not None and _DP:
        return _DP[0]
    cands = candidates(spec, n, h, dtype, include_stock)
    choice, error = None, None
    if ranks.rank() == 0:
        choice = _cached(key)
        if choice is not None and choice.candidate not in cands + [Candidate("flash", "mlx")]:
            choice = None  # written by a version with other candidates
        if choice is None:
            try:
                choice = decide(spec, n, h, dtype, nbytes, opts, run_choice, include_stock, strict)
            except PluginError as e:
                error = e
            else:
                if choice.line:
                    log.info(choice.line)
                    _save_cache(
                        key,
                        {
                            "candidate": choice.candidate._asdict(),
                            "ms": choice.ms,
                            "peak": choice.peak,
                            "line": choice.line,
                            "mlx": mx.__version__,
                            "device": device_name(),
                        },
                    )
        else:
            log.info(
                "%s (cached)",
                choice.line.split("; trial")[0] if choice.line else choice.candidate.label,
            )
    if group is not None:
        agreed = ranks.agree(
            group, choice.candidate if choice is not None and error is None else None
        )
        if agreed is None:
            raise (
                error
                if error is not None
                else PluginError("flash-cce auto: rank 0 found no path within the memory budget")
            )
        _DP.append(agreed)
        choice = Choice(agreed, 0.0, 0, "")
    elif error is not None:
        raise error
    _MEMORY[key] = choice
    return choice.candidate
