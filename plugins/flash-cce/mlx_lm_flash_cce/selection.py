"""The one place a call's path is chosen: ``select``, and ``run`` that runs it.

A request (``impl``, ``backend``; see ``request``) either names a path or
leaves it open:

- ``impl="stock"`` / ``"chunked"``: that path;
- ``impl="flash"`` with ``backend=`` a flash path's name (``mlx``,
  ``mlx-blocks``, ``cuda-gemm``, ``cuda``): that path;
- ``impl="auto"`` with a named backend: the stock head below
  ``MIN_FLASH_ELEMENTS`` logits, else that path;
- ``impl="auto"`` / ``"flash"`` with ``backend="auto"``: the stock head below
  the crossover (``auto`` only), else the measuring choice among the paths
  that can run the call here (``autotune.choose``; ``flash`` leaves the
  stock head out, and the two never share a cached decision). Calls the
  trial does not cover (a head with a bias or LoRA, the gradient filters,
  a ``vocab_chunk`` set by the caller) take the first of ``cuda``,
  ``mlx-blocks`` (on a GPU, big blocks) and ``mlx`` that can run them.

A named path that cannot run the call here is an error that says why; a
path never runs another in its place. A head that is only a callable
(DoRA, custom modules) has no rows to slice: ``auto`` runs it ``chunked``
and ``flash`` is an error.
"""

import logging
from typing import Dict, NamedTuple, Optional

import mlx.core as mx

from . import autotune, backends, heads, portable
from . import budget as _budget
from .candidate import FLASH, GPU_BLOCKS, MIB, Candidate, Path

log = logging.getLogger("mlx_lm_flash_cce")

IMPLS = ("auto", "flash", "stock", "chunked")

# Below this many logits (tokens x vocab) "auto" runs the stock head: there
# both take milliseconds and the stock head is the simpler path (the
# crossover is measured in benchmarks/results/flash-cce-cpu.md).
MIN_FLASH_ELEMENTS = 1 << 19

_SAID = set()  # deprecated spellings already logged


class Request(NamedTuple):
    impl: str = "auto"  # auto | flash | stock | chunked
    backend: str = "auto"  # auto, or the flash path to run when one runs
    step: Optional[str] = None  # "mlx-f32": mlx-blocks' float32 step (a benchmark variant)


class Plan(NamedTuple):
    path: Path
    opts: portable.Options  # with the candidate's blocks
    limit_mib: int = 0  # MLX's memory limit above the inputs to hold (GPU), 0: none
    explicit_budget: bool = False  # the user's budget: the limit is held that tight


def _deprecated(old: str, new: str) -> None:
    if old not in _SAID:
        _SAID.add(old)
        log.warning("flash-cce: %s is deprecated: it is %s", old, new)


def request(
    impl: str = "auto", backend: str = "auto", elementwise: Optional[str] = None
) -> Request:
    """The request of ``linear_cross_entropy``'s ``impl``, ``backend`` and ``elementwise``.

    ``elementwise`` is deprecated: the path names its step (``cuda-gemm``:
    the CUDA row kernel, ``mlx-blocks``: the compiled MLX step); its old
    spellings map onto those paths with a warning, ``"mlx-f32"`` selects
    ``mlx-blocks``' float32 step.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if backend != "auto" and backend not in backends.names():
        raise ValueError(
            f"unknown flash-cce path {backend!r} (have: auto, {', '.join(backends.names())})"
        )
    if elementwise in (None, "auto") or (elementwise, backend) == ("kernel", "cuda-gemm"):
        return Request(impl, backend)
    if elementwise in ("mlx", "mlx-f32") and backend in ("mlx", "cuda-gemm", "mlx-blocks"):
        if backend != "mlx-blocks":
            _deprecated(
                f"backend={backend!r} with elementwise={elementwise!r}", "backend='mlx-blocks'"
            )
        return Request(impl, "mlx-blocks", "mlx-f32" if elementwise == "mlx-f32" else None)
    raise ValueError(
        f"elementwise={elementwise!r} does not apply to backend={backend!r}: the step is the "
        "path's (backend='cuda-gemm': the CUDA row kernel; 'mlx-blocks': the MLX step, "
        "elementwise='mlx-f32' its float32 variant)"
    )


def _fixed(req: Request, spec: heads.Head, n: int, min_flash_elements: Optional[int]):
    """The path the request names for this call, or None (measure)."""
    if spec.kind == "module":
        if req.impl == "flash":
            raise ValueError(
                f"impl='flash' needs a head given as arrays or a known layer; "
                f"{type(spec.module).__name__} is only a callable (use 'chunked' or 'auto')"
            )
        return Path.STOCK if req.impl == "stock" else Path.CHUNKED
    if req.impl in ("stock", "chunked"):
        return Path(req.impl)
    threshold = MIN_FLASH_ELEMENTS if min_flash_elements is None else min_flash_elements
    if req.impl == "auto" and n * spec.vocab < threshold:
        return Path.STOCK
    return None if req.backend == "auto" else Path(req.backend)


def _big(opts: portable.Options) -> bool:
    """Blocks big enough that a GPU queues them far ahead (they need MLX's backpressure)."""
    return not opts.vocab_chunk or opts.token_chunk * opts.vocab_chunk >= backends.BIG_BLOCK


def _limit(path: Path, opts: portable.Options) -> int:
    big = path in (Path.MLX_BLOCKS, Path.CUDA_GEMM) and _big(opts)
    return GPU_BLOCKS[0][2] if big and _budget.is_async_gpu() else 0


def _with_blocks(cand: Candidate, opts: portable.Options) -> portable.Options:
    if cand.vocab_chunk:
        return opts._replace(token_chunk=cand.token_chunk, vocab_chunk=cand.vocab_chunk)
    return opts


def _trial_covers(spec: heads.Head, opts: portable.Options) -> bool:
    """The trial measures plain heads in the paths' own blocks, with exact gradients."""
    plain = spec.bias is None and not spec.has_lora
    exact = opts.filter_eps is None and opts.block_skip_eps is None
    return plain and exact and not opts.vocab_chunk


def _untuned(spec, h, opts, runnable) -> Candidate:
    """A call the trial does not cover: the first of cuda, mlx-blocks (GPU), mlx that runs it."""
    gpu = _budget.is_async_gpu()
    order = [Path.CUDA] + ([Path.MLX_BLOCKS] if gpu and _big(opts) else []) + [Path.MLX]
    path = next(p for p in order if p in runnable)
    log.debug("flash-cce: path %s (no trial for this head or these options)", path)
    return Candidate(path, limit_mib=_limit(path, opts))


def select(
    req: Request,
    spec: heads.Head,
    h: mx.array,
    nbytes: Optional[int],
    opts: portable.Options,
    min_flash_elements: Optional[int] = None,
) -> Plan:
    """The path for this call (``h`` is ``[N, H]``); the only reader of the registry and the trial.

    ``nbytes``: the memory budget (None: the default for the batch).
    """
    from mlx_lm_ext.api import PluginError

    opts = opts._replace(elementwise=req.step)
    explicit = nbytes is not None
    path = _fixed(req, spec, h.shape[0], min_flash_elements)
    if path is not None:
        why = backends.refuses(path, spec, h, opts)
        if why is not None:
            raise PluginError(f"flash-cce path {path.value!r} cannot run this call here: {why}")
        return Plan(path, opts, _limit(path, opts), explicit)
    runnable = [p for p in FLASH if backends.refuses(p, spec, h, opts) is None]
    if not _trial_covers(spec, opts):
        cand = _untuned(spec, h, opts, runnable)
    else:
        frozen = {"weight": False, "bias": False, "lora": False}

        def run_choice(cand, head, x, targets):
            return backends.per_token(cand.path)(head, x, targets, _with_blocks(cand, opts), frozen)

        n, hid = h.shape
        auto = req.impl == "auto"
        cand = autotune.choose(
            spec, n, hid, h.dtype, nbytes, opts, run_choice, include_stock=auto, runnable=runnable
        )
    return Plan(cand.path, _with_blocks(cand, opts), cand.limit_mib, explicit)


def run(
    plan: Plan,
    spec: heads.Head,
    h: mx.array,
    t: mx.array,
    train: Optional[Dict[str, bool]],
) -> mx.array:
    """Per-token loss ``[N]`` of ``spec`` on ``h`` by ``plan``'s path (and its memory limit)."""
    if plan.limit_mib and _budget.is_async_gpu():
        floor = 0 if plan.explicit_budget else _budget.device_floor()
        _budget.LIMIT.hold(plan.limit_mib * MIB, floor)
    return backends.per_token(plan.path)(spec, h, t, plan.opts, train)
