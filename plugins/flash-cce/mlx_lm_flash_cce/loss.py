"""``make_loss(model)``: mlx-lm's ``default_loss`` without the logits.

Each architecture's output is ``post(head(hidden(inputs)))``. A registry
says, per mlx-lm model module, how to get the final hidden states, which
module is the head, and the final logit transform (a scale, a soft cap).
Models not in the registry get the common rule (``model.model(inputs)``,
then ``lm_head`` or the tied input embedding). Either way a one-time
self-check compares the decomposition with the model's own logits on a
short input; on a mismatch the loss falls back to mlx-lm's stock loss with
a warning, so a wrong guess costs memory, never correctness.
"""

import logging
from typing import Any, Callable, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_ext.api import backbone

from . import api

log = logging.getLogger("mlx_lm_flash_cce")

CHECK_TOKENS = 12


# The decomposition is the host's (``mlx_lm_ext.backbone``), shared with the
# drafters that read hidden states; re-exported for this package's users.
Arch, ARCHS, STANDARD = backbone.Arch, backbone.ARCHS, backbone.STANDARD
arch_name, resolve = backbone.arch_name, backbone.resolve


def stock_loss(model: Any, batch: mx.array, lengths: mx.array) -> Tuple[mx.array, mx.array]:
    """mlx-lm's ``default_loss`` (looked up at call time)."""
    from mlx_lm.tuner.trainer import default_loss

    return default_loss(model, batch, lengths)


def _check_input(model, vocab):
    key = mx.random.key(12345)  # never touch the global RNG the trainer saves
    return mx.random.randint(0, vocab, (1, CHECK_TOKENS + 1), key=key)


def self_check(model: Any, arch: Arch, options: Dict[str, Any]) -> Tuple[bool, float, str]:
    """Compare the decomposition with ``model(x)``; return ``(ok, max_error, message)``."""
    was_training = model.training
    model.eval()  # no dropout while comparing
    try:
        head = arch.head(model)
        softcap, scale = arch.softcap(model), arch.logit_scale(model)
        probe = mx.zeros((1, 1), dtype=mx.int32)
        vocab = model(probe).shape[-1]
        batch = _check_input(model, vocab)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs).astype(mx.float32)
        want = nn.losses.cross_entropy(logits, targets)
        hidden = arch.hidden(model, inputs)
        flash_opts = {k: v for k, v in options.items() if k not in ("impl", "min_flash_elements")}
        if flash_opts.get("backend", "auto") == "auto":
            flash_opts["backend"] = "mlx"  # checks the decomposition; no trial on a 12-token input
        got = api.linear_cross_entropy(
            hidden,
            head,
            targets,
            softcap=softcap,
            logit_scale=scale,
            reduction="none",
            impl="flash" if _sliceable(head) else "chunked",
            **flash_opts,
        )
        err = mx.max(mx.abs(got - want) / mx.maximum(mx.abs(want), 1.0)).item()
    except Exception as e:  # a registry entry that does not fit this model
        return False, float("inf"), f"{type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    half = logits.dtype != mx.float32 or hidden.dtype != mx.float32
    tol = 5e-2 if half else 1e-3
    if not err <= tol:  # also catches NaN
        return (
            False,
            err,
            f"per-token loss differs from the model's own by {err:.3g} (tolerance {tol:g})",
        )
    return True, err, f"matches the model's logits (max relative error {err:.2g})"


def _sliceable(head):
    from . import heads

    try:
        return heads.as_head(head).kind != "module"
    except (TypeError, ValueError):
        return False


def make_loss(
    model: Any, *, check: bool = True, verbose: bool = True, **options: Any
) -> Callable[..., Tuple[mx.array, mx.array]]:
    """A loss with ``default_loss``'s signature, mask and value, without ``[N, V]`` logits.

    ``options`` go to ``linear_cross_entropy`` (``token_chunk``,
    ``vocab_chunk``, ``filter_eps``, ``impl``, ``backend`` ...). The
    returned function has attributes ``flash`` (False when it fell back to
    the stock loss), ``arch`` and ``check`` (the self-check message).
    """
    name, arch = resolve(model)
    message = "self-check skipped"
    if check:
        ok, _, message = self_check(model, arch, options)
        if not ok:
            log.warning(
                "flash-cce: %s model (%s) does not fit the %s rule: %s; using mlx-lm's stock loss",
                name,
                type(model).__name__,
                "registry" if name != "generic" else "generic",
                message,
            )
            stock_loss.flash, stock_loss.arch, stock_loss.check = False, name, message
            return stock_loss
    said = []

    def loss(model, batch, lengths):
        inputs = batch[:, :-1]
        targets = batch[:, 1:]
        hidden = arch.hidden(model, inputs)

        steps = mx.arange(1, targets.shape[1] + 1)
        mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])

        # Loss-only calls (mlx-lm's evaluate runs in eval mode) skip the
        # gradient half of the pass; training computes it in the same sweep.
        ce = api.linear_cross_entropy(
            hidden,
            arch.head(model),
            targets,
            softcap=arch.softcap(model),
            logit_scale=arch.logit_scale(model),
            reduction="none",
            with_grad=model.training,
            **options,
        )
        if verbose and not said and model.training:
            said.append(True)
            _report(name, hidden, arch.head(model), targets, options)
        ce = ce * mask
        ntoks = mask.sum()
        ce = ce.astype(mx.float32).sum() / ntoks
        return ce, ntoks

    loss.flash, loss.arch, loss.check = True, name, message
    if verbose:
        log.info(
            "flash-cce: %s model, loss from hidden states and head; self-check: %s", name, message
        )
    return loss


def _report(name, hidden, head, targets, options):
    """One line on what the stock loss would have held for this batch."""
    from . import heads

    try:
        spec = heads.as_head(head)
        vocab = spec.vocab or None
    except (TypeError, ValueError):
        vocab = None
    if not vocab:
        return
    n_tok = targets.size
    logit_bytes = n_tok * vocab * hidden.dtype.size
    log.info(
        f"flash-cce: batch of {n_tok} tokens x {vocab} vocab: the stock loss holds "
        f"[{n_tok}, {vocab}] logits and their gradient ({2 * logit_bytes / 2**20:.0f} MiB and up); "
        f"flash-cce {_how(options, n_tok, vocab)}"
    )


def _how(options, n_tok, vocab):
    """What the requested path does with the batch, in the blocks that path itself picks."""
    from . import backends, portable, selection
    from .candidate import Path

    req = selection.request(
        options.get("impl", "auto"), options.get("backend", "auto"), options.get("elementwise")
    )
    if req.impl in ("stock", "chunked"):
        return f"runs its {req.impl!r} path, as asked"
    if req.backend == "auto":
        return (
            "runs the fastest path within the memory budget (the 'flash-cce auto' line says which)"
        )
    path = Path(req.backend)
    if path is Path.CUDA:
        return "runs fused CUDA kernels (cuda backend)"
    opts = portable.Options(**{k: v for k, v in options.items() if k in portable.Options._fields})
    nc, vc = backends.blocks(path, opts, n_tok, vocab)
    if path is Path.MLX:  # its block logits are float32 on every device
        return f"works in [{nc}, {vc}] float32 blocks ({nc * vc * 4 / 2**20:.1f} MiB each)"
    return f"runs one pass in [{nc}, {vc}] blocks ({path.value} backend)"
