"""The fused CUDA backend: two ``mx.fast.cuda_kernel`` kernels, no ``[N, V]``.

``cuda_kernels.cuh`` holds the kernels (CUDA C++, compiled by MLX with NVRTC
for the device's architecture the first time each variant runs):

- ``fwd``: tensor-core logits tile by tile (128 tokens x 128 vocabulary
  rows), an online max and sum per token, and the target's logit. The grid
  splits the vocabulary; each split writes its ``(max, sum)`` per token and
  MLX merges the splits into the log-sum-exp (a few ``[splits, N]`` floats).
- ``bwd`` (in the VJP): recomputes the logits 512 vocabulary rows at a time,
  keeps ``D = (softmax - onehot) * dz`` in shared memory and adds
  ``g * D @ W`` to a float32 hidden gradient with atomics.

Dense bf16/fp16 heads are read with ``cp.async``; affine 4/8-bit heads
(group size 32, 64 or 128) are dequantized into shared memory inside the
kernels. The loss-head memory is the float32 hidden gradient (``N x H``)
plus its cast, against four ``[N, V]`` arrays for the stock loss.

Everything else is refused (``unsupported`` says why; ``selection.select``
then picks another path, or reports the reason when the path was asked
for): float32 or mixed dtypes, heads with an output bias or LoRA,
mxfp/nvfp quantization, hidden sizes that are not a multiple of 64. A dense
head whose weight is trainable gets its gradient from the pure-MLX sweep
(built lazily: it costs nothing unless that gradient is asked for).

This module imports on any MLX; the kernels are built on first use, and
``available()`` is true only where the default device is a CUDA GPU.
"""

import logging
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Tuple

import mlx.core as mx

from . import heads as _heads
from . import portable

log = logging.getLogger(__name__)

# Mirrors of the constants in cuda_kernels.cuh (shared memory is passed in bytes).
NT, BM, BN, BK, PAD, RC, BH, KB = 256, 128, 128, 64, 8, 512, 128, 64
LDK, LDD, LDW, NSLICE = BK + PAD, RC + PAD, BH + PAD, RC // KB
FWD_SMEM = 2 * (BM + BN) * LDK * 2 + 4 * BM * 4 + BM * 4
_STAGE = max(2 * (BM + BN) * LDK * 2, 2 * KB * LDW * 2)
BWD_SMEM = BM * LDD * 2 + _STAGE + 3 * BM * 4 + 4 * NSLICE * 4 + (NSLICE + 1) * 4

# Multiprocessors the grid is sized for (H100 / H200: 132). Any count works;
# this only sets how the vocabulary is split across blocks.
SMS = 132

DTYPES = (mx.bfloat16, mx.float16)
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)

HEADER = (Path(__file__).with_name("cuda_kernels.cuh")).read_text()


def available() -> bool:
    """True where the default device is a GPU of MLX's CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def supports(head: _heads.Head, opts: portable.Options) -> bool:
    """Heads the kernels take at all (dtypes and shapes are checked per call)."""
    return head.kind in ("dense", "quantized") and head.bias is None and not head.has_lora


def unsupported(
    head: _heads.Head, hidden: mx.array, train: Optional[Dict[str, bool]] = None
) -> Optional[str]:
    """Why this call cannot run on the kernels (None: it can)."""
    if head.kind not in ("dense", "quantized"):
        return f"{head.kind} head"
    if head.bias is not None:
        return "head with an output bias"
    if head.has_lora:
        return "LoRA on the head"
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        return f"hidden of shape {tuple(hidden.shape)}"
    if hidden.dtype not in DTYPES:
        return f"hidden dtype {hidden.dtype} (kernels take bfloat16 and float16)"
    h = hidden.shape[1]
    if h % BK:
        return f"hidden size {h} is not a multiple of {BK}"
    if head.kind == "dense":
        if head.weight.dtype != hidden.dtype:
            return f"head dtype {head.weight.dtype} differs from hidden dtype {hidden.dtype}"
        if head.weight.shape[1] != h:
            return f"head shape {tuple(head.weight.shape)} does not match hidden size {h}"
        return None
    if head.mode != "affine" or head.biases is None:
        return f"{head.mode} quantization (kernels take affine)"
    if head.bits not in BITS or head.group_size not in GROUP_SIZES:
        return f"{head.bits}-bit, group size {head.group_size} (kernels take 4/8 bits, groups 32/64/128)"
    if head.scales.dtype != hidden.dtype:
        return f"quantization scales dtype {head.scales.dtype} differs from hidden dtype {hidden.dtype}"
    if head.weight.shape[1] * 32 // head.bits != h:
        return f"quantized head does not match hidden size {h}"
    return None


# ------------------------------------------------------------------ kernels

_KERNELS = {}


def _kernel(kind, quantized):
    key = (kind, quantized)
    if key in _KERNELS:
        return _KERNELS[key]
    inputs = ["hid", "tgt"] + (["lse", "gco"] if kind == "bwd" else []) + ["w"]
    if quantized:
        inputs += ["scales", "biases"]
        head_args = "w, scales, biases"
        group = "hid_shape[1] / scales_shape[1]"
        bits = "QB"
    else:
        head_args = "w, (const T*)nullptr, (const T*)nullptr"
        group = "0"
        bits = "0"
    inputs.append("prm")
    dims = f"hid_shape[0], hid_shape[1], w_shape[0], {group}, prm"
    if kind == "fwd":
        outputs = ["m_out", "l_out", "zt_out"]
        body = f"cce::fwd<T, {bits}>(hid, tgt, {head_args}, {dims}, m_out, l_out, zt_out);"
        smem = FWD_SMEM
    else:
        outputs = ["dh"]
        body = f"cce::bwd<T, {bits}>(hid, tgt, lse, gco, {head_args}, {dims}, dh);"
        smem = BWD_SMEM
    _KERNELS[key] = mx.fast.cuda_kernel(
        name=f"flash_cce_{kind}_{'q' if quantized else 'dense'}",
        input_names=inputs,
        output_names=outputs,
        source=body,
        header=HEADER,
        ensure_row_contiguous=True,
        shared_memory=smem,
    )
    return _KERNELS[key]


def fwd_splits(n_tok: int, vocab: int) -> int:
    """Vocabulary splits of the forward grid: about 4 blocks per multiprocessor."""
    nbx = -(-n_tok // BM)
    nvb = -(-vocab // BN)
    return max(1, min(nvb, -(-4 * SMS // nbx)))


def bwd_splits(n_tok: int, vocab: int) -> int:
    """Vocabulary splits of the backward grid (one block per multiprocessor).

    The smallest split count that fills the machine to 90% in whole waves,
    else the best fill; any count is correct.
    """
    nbx = -(-n_tok // BM)
    nchunk = -(-vocab // RC)
    best, best_eff = 1, 0.0
    for s in range(1, min(nchunk, 64) + 1):
        ctas = nbx * s
        eff = ctas / (-(-ctas // SMS) * SMS)
        if ctas >= SMS and eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


class Config(NamedTuple):
    quantized: bool
    bits: int
    scale: float
    softcap: float
    filter_eps: float
    block_skip_eps: float
    train_weight: bool


def _params(cfg):
    return mx.array([cfg.scale, cfg.softcap, cfg.filter_eps, cfg.block_skip_eps], dtype=mx.float32)


def _template(cfg, dtype):
    t = [("T", dtype)]
    if cfg.quantized:
        t.append(("QB", cfg.bits))
    return t


def forward(
    cfg: Config, h: mx.array, t: mx.array, vals: Tuple[mx.array, ...]
) -> Tuple[mx.array, mx.array]:
    """``(ce, lse)`` per token, float32."""
    n_tok, vocab = h.shape[0], vals[0].shape[0]
    splits = fwd_splits(n_tok, vocab)
    nbx = -(-n_tok // BM)
    m, l, zt = _kernel("fwd", cfg.quantized)(
        inputs=[h, t, *vals, _params(cfg)],
        template=_template(cfg, h.dtype),
        grid=(NT * nbx, splits, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(splits, n_tok), (splits, n_tok), (n_tok,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
        init_value=0.0,
    )
    top = m.max(axis=0)
    lse = top + mx.log((l * mx.exp(m - top)).sum(axis=0))
    return lse - zt, lse


def backward(
    cfg: Config,
    h: mx.array,
    t: mx.array,
    lse: mx.array,
    dce: mx.array,
    vals: Tuple[mx.array, ...],
) -> mx.array:
    """Hidden-state gradient ``[N, H]`` (float32) for per-token cotangent ``dce``."""
    n_tok, vocab = h.shape[0], vals[0].shape[0]
    nbx = -(-n_tok // BM)
    (dh,) = _kernel("bwd", cfg.quantized)(
        inputs=[h, t, lse, dce.astype(mx.float32), *vals, _params(cfg)],
        template=_template(cfg, h.dtype),
        grid=(NT * nbx, bwd_splits(n_tok, vocab), 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[h.shape],
        output_dtypes=[mx.float32],
        init_value=0.0,
    )
    return dh


def _weight_grad(cfg, h, t, lse, dce, weight):
    """Dense head-weight gradient through the pure-MLX sweep (lazy)."""
    n_tok = h.shape[0]
    st = portable.Static(
        kind="dense",
        names=("weight",),
        group_size=0,
        bits=0,
        mode="affine",
        has_lora=False,
        train_weight=True,
        train_bias=False,
        train_lora=False,
        softcap=cfg.softcap or None,
        logit_scale=None if cfg.scale == 1.0 else cfg.scale,
        token_chunk=min(n_tok, 4096),
        vocab_chunk=min(weight.shape[0], 4096),
        with_grad=False,
        filter_eps=None,
        block_skip_eps=None,
        compute_dtype=h.dtype,
        dequantize=False,
    )
    u = mx.zeros((n_tok, 0), dtype=h.dtype)
    _, _, dhead = portable.sweep(st, h, t, u, {"weight": weight}, lse, dce, need_dh=False)
    return dhead.astype(weight.dtype)


_CORES = {}


def _core(cfg):
    if cfg in _CORES:
        return _CORES[cfg]

    @mx.custom_function
    def core(h, t, *vals):
        return forward(cfg, h, t, vals)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        h, t, *vals = primals
        dce = cotangents[0]
        dh = backward(cfg, h, t, outputs[1], dce, vals).astype(h.dtype)
        grads = [dh, mx.zeros_like(t)]
        for i, v in enumerate(vals):
            if i == 0 and cfg.train_weight:
                grads.append(_weight_grad(cfg, h, t, outputs[1], dce, v))
            else:
                grads.append(mx.zeros_like(v))
        return tuple(grads)

    _CORES[cfg] = core
    return core


def per_token(
    head: _heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Path ``cuda`` (see ``backends``): the kernels; a call they cannot take is an error."""
    reason = unsupported(head, hidden, train)
    if reason is not None:
        raise ValueError(f"flash-cce path 'cuda' cannot take this call: {reason}")
    names, values = _heads.head_arrays(head)
    train = train or {}
    cfg = Config(
        quantized=head.kind == "quantized",
        bits=head.bits if head.kind == "quantized" else 0,
        scale=1.0 if opts.logit_scale is None else float(opts.logit_scale),
        softcap=0.0 if opts.softcap is None else float(opts.softcap),
        filter_eps=0.0 if opts.filter_eps is None else float(opts.filter_eps),
        block_skip_eps=0.0 if opts.block_skip_eps is None else float(opts.block_skip_eps),
        train_weight=head.kind == "dense" and bool(train.get("weight", True)),
    )
    return _core(cfg)(hidden, targets.astype(mx.int32), *values)[0]


def plan(head: Any, hidden: mx.array, train: Optional[Dict[str, bool]] = None) -> str:
    """``"cuda"`` or the reason the kernels refuse the call (for tests and logs)."""
    if not available():
        return "no CUDA GPU as the default device"
    return (
        unsupported(
            _heads.as_head(head) if not isinstance(head, _heads.Head) else head, hidden, train
        )
        or "cuda"
    )
