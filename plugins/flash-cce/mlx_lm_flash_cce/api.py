"""``linear_cross_entropy``: the public call, and the two exact fallbacks.

Three paths compute the same loss:

- ``flash``: the chosen backend (``backends``), never holding ``[N, V]``;
- ``stock``: full logits then cross-entropy in float32, which is faster
  for short inputs (below ``MIN_FLASH_ELEMENTS`` logits, measured in
  ``benchmarks/bench_flash_cce.py``);
- ``chunked``: for heads that are only a callable (DoRA, custom modules):
  the head runs on token chunks under ``mx.checkpoint``, so at most
  ``[token_chunk, V]`` logits live at once.
"""

from typing import Any, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import autotune, backends, heads, portable, qmm
from . import budget as _budget

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "flash", "stock", "chunked")

# Below this many logits (tokens x vocab) "auto" uses the stock-style head.
# Measured on the CPU backend (bench_flash_cce.py --crossover): flash-cce
# matches or beats the stock loss from about 8-16 tokens at V=49152; below
# that both take milliseconds and the stock-style head is the simpler path.
MIN_FLASH_ELEMENTS = 1 << 19


def _cap_logits(z, softcap, logit_scale):
    z = z.astype(mx.float32)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * mx.tanh(z / softcap)
    return z


def _ce_from_logits(logits, targets, softcap, logit_scale):
    z = _cap_logits(logits, softcap, logit_scale)
    zt = mx.take_along_axis(z, targets[:, None], axis=1)[:, 0]
    return mx.logsumexp(z, axis=1) - zt


def _owner(head):
    """The nn.Module whose parameters a callable head uses (or None)."""
    if isinstance(head, nn.Module):
        return head
    owner = getattr(head, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def stock_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
) -> mx.array:
    """Exact per-token loss through the full ``[N, V]`` logits (float32 softmax)."""
    return _full_logits_loss(
        head, hidden, targets, lambda z, t: _ce_from_logits(z, t, softcap, logit_scale)
    )


def native_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
) -> mx.array:
    """mlx-lm's stock loss: ``cross_entropy`` of the logits in the head's own dtype.

    What ``auto`` runs when it picks the stock-style head: the same math and
    memory as ``default_loss`` (a soft cap or scale takes the float32 path).
    """
    if softcap is not None or logit_scale is not None:
        return stock_per_token(head, hidden, targets, softcap, logit_scale)
    return _full_logits_loss(
        head, hidden, targets, lambda z, t: nn.losses.cross_entropy(z, t).astype(mx.float32)
    )


def _full_logits_loss(head, hidden, targets, per_token):
    """``per_token(logits, targets)`` over the full logits, rows padded for the head."""
    x, rows = qmm.pad_rows(hidden)  # the head may be a quantized matmul
    if rows is not None:
        targets = mx.pad(targets, [(0, x.shape[0] - rows)])
    ce = per_token(heads.full_logits(head, x), targets)
    return ce if rows is None else ce[:rows]


def chunked_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    token_chunk: int = 256,
) -> mx.array:
    """Exact per-token loss of a callable head, token chunk by token chunk."""
    call = head.module
    owner = _owner(call)
    params = owner.trainable_parameters() if owner is not None else {}

    def chunk(params, h, t):
        if owner is not None:
            owner.update(params)
        t = mx.stop_gradient(t)  # integer ids: checkpoint would differentiate them
        return stock_per_token(heads.Head(kind="module", module=call), h, t, softcap, logit_scale)

    step = mx.checkpoint(chunk)
    parts = []
    for n0 in range(0, hidden.shape[0], token_chunk):
        parts.append(step(params, hidden[n0 : n0 + token_chunk], targets[n0 : n0 + token_chunk]))
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]


def _choose(impl, head, n_tok, opts_min):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if head.kind == "module":
        if impl == "flash":
            raise ValueError(
                f"impl='flash' needs a head given as arrays or a known layer; "
                f"{type(head.module).__name__} is only a callable (use 'chunked' or 'auto')"
            )
        return "stock" if impl == "stock" else "chunked"
    if impl == "auto":
        threshold = MIN_FLASH_ELEMENTS if opts_min is None else opts_min
        return "stock" if n_tok * head.vocab < threshold else "flash"
    if impl == "chunked":
        return "chunked"
    return impl


def linear_cross_entropy(
    hidden: mx.array,
    head: Any,
    targets: mx.array,
    *,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    ignore_index: Optional[int] = None,
    reduction: str = "mean",
    impl: str = "auto",
    backend: str = "auto",
    token_chunk: int = 256,
    vocab_chunk: int = 0,
    chunk_elements: int = 1 << 18,
    filter_eps: Optional[float] = None,
    block_skip_eps: Optional[float] = None,
    with_grad: bool = True,
    min_flash_elements: Optional[int] = None,
    dequantize: Optional[bool] = None,
    train: Optional[Dict[str, bool]] = None,
    elementwise: Optional[str] = None,
    memory_budget: Union[int, float, str, None] = None,
) -> mx.array:
    """Cross-entropy of ``head(hidden)`` against ``targets`` without ``[N, V]`` logits.

    Equals ``nn.losses.cross_entropy(logits, targets)`` reduced by
    ``reduction``, where ``logits = head(hidden)`` times ``logit_scale`` and
    then soft-capped as ``softcap * tanh(logits / softcap)``; the loss is
    computed in float32. Tokens whose target is ``ignore_index`` count zero
    and are left out of the mean. Gradients flow to ``hidden`` and to the
    head's arrays (a weight array, a dense layer's weight and bias, LoRA
    factors); a quantized layer's packed weight has none.

    ``head``: a ``[V, H]`` array, ``nn.Linear``, ``nn.QuantizedLinear``, an
    (quantized) embedding or its ``as_linear``, mlx-lm's ``LoRALinear`` /
    ``LoRAEmbedding``, or any callable (then computed by token chunks).

    Tuning (results are exact unless an eps is set):
    ``impl``: ``auto`` (stock-style below ``min_flash_elements`` logits,
    else the fastest path within the memory budget), ``flash`` (never the
    full logits), ``stock``, ``chunked``. ``backend``: ``auto`` (measured
    once per shape bucket on this device and cached, see ``autotune``) or
    a name from ``backends.names()``. ``memory_budget``: the most working
    memory the loss head may use above its inputs, bytes or ``"512M"`` /
    ``"2G"`` (default: half of what the stock head would hold for this
    call, at most ``budget.DEFAULT_CAP``); ``auto`` keeps to it. ``token_chunk`` tokens per pass;
    ``vocab_chunk`` vocabulary rows per block (0: ``chunk_elements //
    token_chunk``). ``with_grad``: compute the hidden gradient in the
    forward pass (one sweep); ``False`` for loss-only calls, where a
    gradient, if asked for anyway, takes a second sweep. ``filter_eps`` /
    ``block_skip_eps``: approximate gradients that skip 64x64 tiles / 64-wide
    vocabulary blocks whose softmax coefficients stay below eps (dense
    heads; the loss value stays exact). ``train``: for layer heads, which
    parts get gradients (``{"weight", "bias", "lora"}`` -> bool); by default
    those the layer has trainable. ``elementwise`` (backend ``cuda-gemm``):
    ``"kernel"`` (its CUDA row kernel), ``"mlx"`` (compiled MLX ops) or None
    (the kernel on a CUDA GPU).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    spec = heads.as_head(head)
    if hidden.ndim < 1 or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match hidden shape {tuple(hidden.shape)} "
            "(want hidden [..., H] and targets [...])"
        )
    if not mx.issubdtype(targets.dtype, mx.integer):
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)

    valid = None
    if ignore_index is not None:
        valid = t != ignore_index
        t = mx.where(valid, t, 0)

    nbytes = _budget.resolve(memory_budget)
    chosen = _choose(impl, spec, h.shape[0], min_flash_elements)
    if chosen == "stock":
        ce = stock_per_token(spec, h, t, softcap, logit_scale)
    elif chosen == "chunked":
        ce = chunked_per_token(spec, h, t, softcap, logit_scale, token_chunk)
    else:
        if train is None:
            train = _trainable_parts(spec)
        opts = portable.Options(
            softcap=softcap,
            logit_scale=logit_scale,
            token_chunk=token_chunk,
            vocab_chunk=vocab_chunk,
            chunk_elements=chunk_elements,
            with_grad=with_grad,
            filter_eps=filter_eps,
            block_skip_eps=block_skip_eps,
            dequantize=dequantize,
            elementwise=elementwise,
        )
        cand = _candidate(impl, backend, spec, h, nbytes, opts)
        if cand.limit_mib and _budget.is_async_gpu():
            _budget.LIMIT.hold(
                cand.limit_mib * autotune.MIB, 0 if nbytes else _budget.device_floor()
            )
        ce = run_candidate(cand, spec, h, t, opts, train)

    if valid is not None:
        ce = mx.where(valid, ce, 0.0)
    if reduction == "none":
        return ce.reshape(targets.shape)
    total = ce.sum()
    if reduction == "sum":
        return total
    if valid is None:
        return total / t.size
    return total / mx.maximum(valid.sum(), 1)


def _candidate(impl, backend, spec, h, nbytes, opts):
    """The path for a flash call: measured (``backend="auto"``) or the one named."""
    frozen = {"weight": False, "bias": False, "lora": False}
    tunable = (
        spec.bias is None
        and not spec.has_lora
        and opts.filter_eps is None
        and opts.block_skip_eps is None
    )
    if backend == "auto" and tunable and not opts.vocab_chunk:

        def run(cand, head, x, targets):
            return run_candidate(cand, head, x, targets, opts, frozen)

        return autotune.choose(
            spec, h.shape[0], h.shape[1], h.dtype, nbytes, opts, run, include_stock=impl == "auto"
        )
    if backend == "auto":
        backend = next(n for n in backends.available() if backends.supports(n, spec, opts))
    big = backend in ("mlx", "cuda-gemm") and backends.big_blocks(backend, spec, opts)
    return autotune.Candidate("flash", backend, limit_mib=autotune.GPU_BLOCKS[0][2] if big else 0)


def run_candidate(
    cand: autotune.Candidate,
    spec: heads.Head,
    h: mx.array,
    t: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]],
) -> mx.array:
    """Per-token loss ``[N]`` of ``spec`` on ``h`` by candidate path ``cand``."""
    if cand.impl == "stock":
        return native_per_token(spec, h, t, opts.softcap, opts.logit_scale)
    if cand.vocab_chunk:
        opts = opts._replace(token_chunk=cand.token_chunk, vocab_chunk=cand.vocab_chunk)
    return backends.resolve(cand.backend, spec, opts)(spec, h, t, opts, train)


def _trainable_parts(spec):
    """Which head parts a layer trains (arrays: all of them)."""
    module = spec.module
    if not isinstance(module, nn.Module):
        return None  # a raw array: its gradient may be asked for
    from mlx.utils import tree_flatten

    names = {k for k, _ in tree_flatten(module.trainable_parameters())}
    return {
        "weight": any(n.endswith("weight") and "lora" not in n for n in names),
        "bias": any(n.endswith(".bias") or n == "bias" for n in names),
        "lora": any("lora_" in n for n in names),
    }
