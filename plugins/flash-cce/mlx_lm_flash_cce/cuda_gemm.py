"""The big-block paths ``cuda-gemm`` and ``mlx-blocks``: both products through ``mx.matmul``.

The fused ``cuda`` kernels do three GEMM-sized passes with ``mma.sync``,
slower than cuBLAS's ``wgmma`` on Hopper; the stock loss does two through
cuBLAS (throughputs in benchmarks/results/flash-cce-h200.md). These paths
keep cuBLAS for both products and bound memory by
working in ``[token_chunk, vocab_chunk]`` blocks (``blocks``; ``mlx-blocks``
sets its own, ``backends``),
in one pass with online rescaling (as ``portable`` does):

    z   = h_c @ W_v.T                       cuBLAS, compute dtype (bf16) in and out
    m', a, l', P = step(z, m, l)            ONE fused elementwise step per block
    acc = acc * a + (P @ W_v)               cuBLAS, bf16 operands; acc float32 [Tc, H]

and at the end ``lse = m + log l`` and ``d = acc / l - dz_t W_t``, the
hidden-state gradient per unit cotangent (the custom VJP multiplies it by
the incoming cotangent). ``step`` is, for path ``cuda-gemm``
(``elementwise="kernel"``), a small CUDA kernel (``rows.ROW_SOURCE``,
compiled once per machine by ``nvrtc`` and run through
``mx.fast.precompiled_cuda_kernel``: one thread block per token row reads
the bf16 logits twice, from L2 the second time, and writes ``P`` once), and
for path ``mlx-blocks`` (``elementwise="mlx"``) an ``mx.compile``d MLX
function. Logits are rounded to the compute dtype by the matmul as in the
stock loss; max, sum and the accumulator are float32.

Memory: MLX evaluates asynchronously and on CUDA queues work far ahead of
the GPU, freeing a block's buffers only when the GPU is done with it; every
block's matmul input depends on the previous block's accumulators
(``mx.depends``), so the loss is one chain, but that orders the work, it
does not stop the queue from allocating ahead. ``mx.eval`` inside the loss
is no way out: under ``mx.grad`` MLX retains the graph of what it
evaluates (every block stays alive; measured on the CPU) and under
``mx.compile`` it is an error. What bounds the memory on CUDA is MLX's own
backpressure, ``mx.set_memory_limit``: above the limit the evaluator waits
for queued work before it allocates more. ``bounded_memory(extra_mib)`` sets
it for a ``with`` block (the benchmark's "limit" rows); on the CPU the
backend allocates only ~100 operations ahead and needs nothing.

Heads: dense (any float dtype) and quantized (rows dequantized per vocab
block, then the same dense GEMMs). Heads with an output bias or LoRA, and
callables, are refused (path ``mlx`` takes them). A trainable dense weight gets its
gradient from the pure-MLX second sweep inside the VJP (lazy: free when the
head is frozen). ``with_grad=False`` (loss only) skips ``P @ W``; a gradient
asked for anyway then takes the pure-MLX sweep with this backend's blocks.
"""

import contextlib
import logging
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import mlx.core as mx

from . import heads as _heads
from . import portable
from . import rows as _rowk

log = logging.getLogger(__name__)

TOKEN_CHUNK = 8192  # used unless the caller sets vocab_chunk (then token_chunk, vocab_chunk)
VOCAB_CHUNK = 8192
ELEMENTWISE = ("auto", "kernel", "mlx", "mlx-f32")
KERNEL_DTYPES = (mx.bfloat16, mx.float16, mx.float32)  # the row kernel's logits


def available() -> bool:
    """Pure MLX plus an optional CUDA kernel: runs on any device."""
    return True


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def supports(head: _heads.Head, opts: portable.Options) -> bool:
    return head.kind in ("dense", "quantized") and head.bias is None and not head.has_lora


@contextlib.contextmanager
def bounded_memory(extra_mib: float) -> Iterator[None]:
    """``mx.set_memory_limit(active + extra_mib)`` for the ``with`` block: MLX's backpressure."""
    old = mx.set_memory_limit(int(mx.get_active_memory() + extra_mib * 2**20))
    try:
        yield
    finally:
        mx.set_memory_limit(old)


class Config(NamedTuple):
    kind: str
    names: tuple
    group_size: int
    bits: int
    mode: str
    softcap: Optional[float]
    logit_scale: Optional[float]
    token_chunk: int
    vocab_chunk: int
    with_grad: bool
    compute_dtype: mx.Dtype
    kernel: bool  # the CUDA row kernel for the elementwise step (else compiled MLX)
    train_weight: bool
    lean: bool = True  # the MLX step without float32 [Tc, Vc] arrays (see mlx_step)


def mlx_step(cfg: Config, lean: bool = True) -> Callable[..., Tuple[mx.array, ...]]:
    """Compiled MLX version of ``kernel_step`` for ``cfg``'s soft cap and scale.

    ``lean`` (the pure-MLX GPU path): the block max is taken on the raw
    logits in their own dtype (exact; capping and a positive scale are
    monotone, so they apply to the max afterwards), ``P`` is written once
    in the blocks' dtype and summed from there, so no float32 ``[Tc, Vc]``
    array is ever written: MLX's compiler fuses elementwise work but not
    reductions, and each float32 intermediate that feeds one is a round
    trip through memory. The sum of bf16 ``P`` rounds each block's sum to
    the blocks' precision (relative 2^-9), finer than the bf16 logits
    themselves. Soft-capped logits (``P = exp(z - m) * dz`` with ``dz`` per
    element) and ``lean=False`` use the pure-MLX backend's float32 step.
    """
    scale = cfg.logit_scale
    if (
        not lean
        or cfg.softcap is not None
        or (scale is not None and scale <= 0)
        or not cfg.with_grad
    ):
        return portable.online_step(cfg, float32_in=True)
    key = ("lean", scale)
    if key not in _LEAN:

        def step(r, m, l):
            top = r.max(axis=1).astype(mx.float32)
            m_new = mx.maximum(m, top if scale is None else top * scale)
            a = mx.exp(m - m_new)
            z = r.astype(mx.float32) if scale is None else r.astype(mx.float32) * scale
            p = mx.exp(z - m_new[:, None])
            if scale is not None:
                p = p * scale  # coef = exp(z - m) * dz, dz = scale
            p = p.astype(r.dtype)
            s = p.sum(axis=1).astype(mx.float32)
            return m_new, a, l * a + (s if scale is None else s / scale), p

        _LEAN[key] = mx.compile(step)
    return _LEAN[key]


_LEAN = {}


def _accumulate(acc, a, pw):
    return acc * a[:, None] + pw.astype(mx.float32)


_ACCUMULATE = mx.compile(_accumulate)

_FINISHES = {}


def _finish(acc, l, wt, dzt, dtype):
    """``acc / l - dz_t * W_t`` in ``dtype``: the hidden gradient per unit cotangent (fused)."""
    if dtype not in _FINISHES:

        def finish(acc, l, wt, dzt):
            return (acc * (1 / l)[:, None] - wt.astype(mx.float32) * dzt[:, None]).astype(dtype)

        _FINISHES[dtype] = mx.compile(finish)
    return _FINISHES[dtype](acc, l, wt, dzt)


def _rows(cfg, arrays, v0, v1):
    """Head rows ``[v0, v1)`` as a dense block of the compute dtype (quantized: dequantized)."""
    head = _heads.Head(kind=cfg.kind, group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
    return _heads.gather_rows(head, arrays, slice(v0, v1), cfg.compute_dtype)


def _forward(cfg, h, t, arrays):
    n_tok, vocab = h.shape[0], arrays["weight"].shape[0]
    cd = cfg.compute_dtype
    nc, vc = cfg.token_chunk, cfg.vocab_chunk
    step = None if cfg.kernel else mlx_step(cfg, lean=cfg.lean)
    head = _heads.Head(kind=cfg.kind, group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
    ces, lses, ds = [], [], []
    gate = []
    for n0 in range(0, n_tok, nc):
        n1 = min(n0 + nc, n_tok)
        hc = h[n0:n1].astype(cd)
        m = mx.full((n1 - n0,), -mx.inf, dtype=mx.float32)
        l = mx.zeros((n1 - n0,), dtype=mx.float32)
        acc = mx.zeros((n1 - n0, h.shape[1]), dtype=mx.float32) if cfg.with_grad else None
        for v0 in range(0, vocab, vc):
            v1 = min(v0 + vc, vocab)
            x = mx.depends(hc, gate) if gate else hc
            w = _rows(cfg, arrays, v0, v1)
            z = x @ w.T
            if cfg.kernel:
                m, a, l, p = _rowk.kernel_step(z, m, l, cfg.softcap, cfg.logit_scale)
            elif cfg.with_grad:
                m, a, l, p = step(z, m, l)
            else:
                m, a, l = step(z, m, l)
            if cfg.with_grad:
                acc = _ACCUMULATE(acc, a, p @ w)
                gate = [acc, l]
            else:
                gate = [l]
        lse = m + mx.log(l)
        # The target's logit as the blocks saw it (a product rounded to the
        # compute dtype) and its head row, without [Tc, H] float32 temporaries.
        wt = _heads.gather_rows(head, arrays, t[n0:n1], cd)
        rt = (hc[:, None, :] @ wt[:, :, None])[:, 0, 0].astype(mx.float32)
        zt, dzt = portable.cap(rt, cfg)
        ces.append(lse - zt)
        lses.append(lse)
        if cfg.with_grad:
            if not isinstance(dzt, mx.array):
                dzt = mx.full(rt.shape, 1.0 if dzt is None else dzt, dtype=mx.float32)
            ds.append(_finish(acc, l, wt, dzt, h.dtype))
            gate = [ds[-1]]
        else:
            gate = [ces[-1]]
    cat = lambda xs: mx.concatenate(xs) if len(xs) > 1 else xs[0]  # noqa: E731
    outs = [cat(ces), cat(lses)]
    if cfg.with_grad:
        outs.append(cat(ds))
    return outs


def _static(cfg, train_weight, with_grad):
    """The pure-MLX sweep's configuration with this backend's blocks."""
    return portable.Static(
        kind=cfg.kind,
        names=cfg.names,
        group_size=cfg.group_size,
        bits=cfg.bits,
        mode=cfg.mode,
        has_lora=False,
        train_weight=train_weight,
        train_bias=False,
        train_lora=False,
        softcap=cfg.softcap,
        logit_scale=cfg.logit_scale,
        token_chunk=cfg.token_chunk,
        vocab_chunk=cfg.vocab_chunk,
        with_grad=with_grad,
        filter_eps=None,
        block_skip_eps=None,
        compute_dtype=cfg.compute_dtype,
        dequantize=True,
    )


_CORES = {}


def _core(cfg):
    if cfg in _CORES:
        return _CORES[cfg]

    @mx.custom_function
    def core(h, t, *values):
        return tuple(_forward(cfg, h, t, dict(zip(cfg.names, values, strict=False))))

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        h, t, *values = primals
        arrays = dict(zip(cfg.names, values, strict=False))
        dce = cotangents[0]
        u = mx.zeros((h.shape[0], 0), dtype=h.dtype)
        dhead = None
        if cfg.with_grad:
            dh = (dce[:, None].astype(mx.float32) * outputs[2]).astype(h.dtype)
            if cfg.train_weight:
                _, _, dhead = portable.sweep(
                    _static(cfg, True, False), h, t, u, arrays, outputs[1], dce, need_dh=False
                )
        else:
            dh, _, dhead = portable.sweep(
                _static(cfg, cfg.train_weight, False),
                h,
                t,
                u,
                arrays,
                outputs[1],
                dce,
                need_dh=True,
            )
            dh = dh.astype(h.dtype)
        grads = [dh, mx.zeros_like(t)]
        for i, v in enumerate(values):
            grads.append(
                dhead.astype(v.dtype) if i == 0 and dhead is not None else mx.zeros_like(v)
            )
        return tuple(grads)

    _CORES[cfg] = core
    return core


def blocks(opts: portable.Options, n_tok: int, vocab: int) -> Tuple[int, int]:
    """``(token_chunk, vocab_chunk)``: the caller's when it set ``vocab_chunk``, else 8192 x 8192."""
    if opts.vocab_chunk:
        nc, vc = opts.token_chunk, opts.vocab_chunk
    else:
        nc, vc = TOKEN_CHUNK, VOCAB_CHUNK
    return max(1, min(nc, n_tok)), max(1, min(vc, vocab))


def row_kernel() -> Optional[bytes]:
    """The row kernel's cubin for this GPU (None: NVRTC is not found or fails)."""
    return _rowk.row_kernel()


def use_kernel(opts: portable.Options, dtype: mx.Dtype) -> bool:
    """The CUDA row kernel for the elementwise step? (``opts.elementwise``: auto/kernel/mlx)."""
    how = getattr(opts, "elementwise", None) or "auto"
    if how not in ELEMENTWISE:
        raise ValueError(f"elementwise must be one of {', '.join(ELEMENTWISE)}, got {how!r}")
    if how in ("mlx", "mlx-f32"):
        return False
    ok = on_cuda() and dtype in KERNEL_DTYPES
    if how == "kernel" and not ok:
        raise ValueError(
            "elementwise='kernel' needs MLX's CUDA backend with a GPU as the default device"
        )
    if ok and row_kernel() is None:  # no NVRTC here: the compiled MLX step
        if how == "kernel":
            raise ValueError("elementwise='kernel': the row kernel does not compile here (NVRTC)")
        return False
    return ok


def per_token(
    head: _heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Paths ``cuda-gemm`` and ``mlx-blocks`` (``backends``): big blocks, one pass.

    The step is ``opts.elementwise``'s (``backends`` sets it per path). A
    head or option the blocks cannot take is an error, never another path.
    """
    if not supports(head, opts) or opts.filter_eps is not None or opts.block_skip_eps is not None:
        raise ValueError(
            "the big-block paths take dense or quantized heads without an output bias or "
            "LoRA and no gradient filters; path 'mlx' takes the rest"
        )
    names, values = _heads.head_arrays(head)
    nc, vc = blocks(opts, hidden.shape[0], head.vocab)
    cd = portable.compute_dtype(opts, hidden.dtype)
    train = train or {}
    cfg = Config(
        kind=head.kind,
        names=tuple(names),
        group_size=head.group_size,
        bits=head.bits,
        mode=head.mode,
        softcap=opts.softcap,
        logit_scale=opts.logit_scale,
        token_chunk=nc,
        vocab_chunk=vc,
        with_grad=opts.with_grad,
        compute_dtype=cd,
        kernel=opts.with_grad and use_kernel(opts, cd),
        train_weight=head.kind == "dense" and bool(train.get("weight", True)),
        lean=getattr(opts, "elementwise", None) != "mlx-f32",
    )
    return _core(cfg)(hidden, targets.astype(mx.int32), *values)[0]
