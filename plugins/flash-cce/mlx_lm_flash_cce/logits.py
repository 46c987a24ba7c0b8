"""The two paths that hold logits: ``stock`` (all of them) and ``chunked`` (a token chunk's).

- ``stock``: the full ``[N, V]`` logits and mlx-lm's cross-entropy, as
  ``default_loss`` computes it (float32 when a soft cap or logit scale
  applies); faster than a flash path for short inputs (below
  ``selection.MIN_FLASH_ELEMENTS`` logits, see
  ``benchmarks/results/flash-cce-cpu.md``);
- ``chunked``: for heads that are only a callable (DoRA, custom modules):
  the head runs on token chunks under ``mx.checkpoint``, so at most
  ``[token_chunk, V]`` logits live at once.

Both take a path's signature, ``(head, hidden, targets, opts, train) -> [N]``.
"""

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import heads, portable, qmm


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


def _full_logits_loss(head, hidden, targets, per_token):
    """``per_token(logits, targets)`` over the full logits, rows padded for the head."""
    x, rows = qmm.pad_rows(hidden)  # the head may be a quantized matmul
    if rows is not None:
        targets = mx.pad(targets, [(0, x.shape[0] - rows)])
    ce = per_token(heads.full_logits(head, x), targets)
    return ce if rows is None else ce[:rows]


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

    The same math and memory as ``default_loss`` (a soft cap or scale takes
    the float32 path).
    """
    if softcap is not None or logit_scale is not None:
        return stock_per_token(head, hidden, targets, softcap, logit_scale)
    return _full_logits_loss(
        head, hidden, targets, lambda z, t: nn.losses.cross_entropy(z, t).astype(mx.float32)
    )


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


def stock_path(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Path ``stock``."""
    return native_per_token(head, hidden, targets, opts.softcap, opts.logit_scale)


def chunked_path(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Path ``chunked``."""
    return chunked_per_token(
        head, hidden, targets, opts.softcap, opts.logit_scale, opts.token_chunk
    )
