"""``linear_cross_entropy``: the public call (validation, ``selection.select``, ``selection.run``).

The paths it can take are ``candidate.Path`` (the registry in ``backends``):
the full logits (``stock``), a callable head by token chunks (``chunked``),
and the flash paths that never hold ``[N, V]`` (``mlx``, ``mlx-blocks``,
``cuda-gemm``, ``cuda``). ``selection`` says how a request picks one.
"""

from typing import Any, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import budget as _budget
from . import heads, portable, selection
from .logits import chunked_per_token, native_per_token, stock_per_token  # noqa: F401 (re-exported)
from .selection import IMPLS, MIN_FLASH_ELEMENTS  # noqa: F401 (re-exported)

REDUCTIONS = ("mean", "sum", "none")


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

    The path (``selection.select`` says how; results are exact unless an
    eps is set): ``impl``: ``auto`` (the stock head below
    ``min_flash_elements`` logits, else the fastest path within the memory
    budget), ``flash`` (only paths that never hold the full logits),
    ``stock``, ``chunked``. ``backend``: the flash path when one runs,
    ``auto`` (measured once per shape bucket and cached, ``autotune``) or
    one of ``backends.names()``; a named path that cannot run the call
    here is an error.
    ``memory_budget``: the most working memory the loss head may use above
    its inputs, bytes or ``"512M"`` / ``"2G"`` (default: half of what the
    stock head would hold for this call, at most ``budget.DEFAULT_CAP``);
    ``auto`` keeps to it. ``token_chunk`` tokens per pass; ``vocab_chunk``
    vocabulary rows per block (0: the path's own blocks). ``with_grad``:
    compute the hidden gradient in the forward pass (one sweep); ``False``
    for loss-only calls, where a gradient, if asked for anyway, takes a
    second sweep. ``filter_eps`` / ``block_skip_eps``: approximate gradients
    that skip 64x64 tiles / 64-wide vocabulary blocks whose softmax
    coefficients stay below eps (dense heads; the loss value stays exact).
    ``train``: for layer heads, which parts get gradients (``{"weight",
    "bias", "lora"}`` -> bool); by default those the layer has trainable.
    ``elementwise``: deprecated (``selection.request``).
    """
    req = selection.request(impl, backend, elementwise)
    spec, h, t = _validated(hidden, head, targets, reduction, softcap)
    valid = None
    if ignore_index is not None:
        valid = t != ignore_index
        t = mx.where(valid, t, 0)
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
    )
    nbytes = _budget.resolve(memory_budget)
    plan = selection.select(req, spec, h, nbytes, opts, min_flash_elements)
    ce = selection.run(plan, spec, h, t, _trainable_parts(spec) if train is None else train)
    return _reduce(ce, valid, reduction, targets.shape)


def _validated(hidden, head, targets, reduction, softcap):
    """``(head spec, hidden [N, H], targets [N])``, or a ValueError on bad input."""
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
    return spec, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


def _reduce(ce, valid, reduction, shape):
    if valid is not None:
        ce = mx.where(valid, ce, 0.0)
    if reduction == "none":
        return ce.reshape(shape)
    total = ce.sum()
    if reduction == "sum":
        return total
    if valid is None:
        return total / ce.size
    return total / mx.maximum(valid.sum(), 1)


def _trainable_parts(spec):
    """Which head parts a layer trains (arrays: all of them)."""
    module = spec.module
    if not isinstance(module, nn.Module) or spec.kind == "module":
        return None  # a raw array: its gradient may be asked for
    from mlx.utils import tree_flatten

    names = {k for k, _ in tree_flatten(module.trainable_parameters())}
    return {
        "weight": any(n.endswith("weight") and "lora" not in n for n in names),
        "bias": any(n.endswith(".bias") or n == "bias" for n in names),
        "lora": any("lora_" in n for n in names),
    }
