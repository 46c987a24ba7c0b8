"""The target model split into backbone and lm-head, for drafters that read
its last hidden state (``Drafter.needs_hidden``)."""

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_lm_ext import api as host
from mlx_lm_ext.api import backbone


def split(model: Any) -> Optional[Tuple[Callable, Callable]]:
    """``(backbone, head)`` with ``head(backbone(x, cache)) == model(x, cache)``,
    or ``None`` when the model does not decompose so (the host's check)."""
    return backbone.split(model)


# ------------------------------------------------ verify-window attention

# MLX's CUDA backend runs multi-token attention in half precision through
# cuDNN, whose graphs are cached by exact shape: a verify window at a new
# cache length builds a new graph (on an H200 a drafting round took several
# times a plain step: benchmarks/results/spec-decode-h200.md). So verify
# forwards there run attention over the cache's whole preallocated buffer
# with an additive mask (``padded_attention``), whose shapes change only when
# the buffer grows: through the fused op ("padded", one request's default)
# or as matmuls ("buffer", a batch's default: rows join and leave, and each
# batch size would build its own cuDNN graphs). "explicit" is matmuls over
# the filled entries alone (a new shape every round), "fused" mlx-lm's own.
# MLX_LM_SPEC_ATTENTION=fused|explicit|padded|buffer|auto overrides both.
EXPLICIT_MAX_QUERIES = 16
POLICIES = ("auto", "fused", "explicit", "padded", "buffer")
AUTO_CUDA = "padded"  # one request
AUTO_CUDA_BATCH = "buffer"  # a batch
GPU_WIDTHS = (4, 8, 12, 16)
PAD_TOKENS = 64  # the most window tokens a batch is padded up to
FLUSH_GPU = 5  # a verify forward's layers per flush on a GPU (host.flush_layers)


def attention_policy(batch: bool = False) -> str:
    """How verify forwards run attention: ``MLX_LM_SPEC_ATTENTION``, else
    (auto) on a CUDA GPU ``AUTO_CUDA`` for one request and ``AUTO_CUDA_BATCH``
    for a ``batch``, elsewhere mlx-lm's fused op."""
    how = os.environ.get("MLX_LM_SPEC_ATTENTION", "auto").strip().lower() or "auto"
    if how not in POLICIES:
        raise ValueError(f"MLX_LM_SPEC_ATTENTION must be one of {', '.join(POLICIES)}, got {how!r}")
    if how == "auto":
        cuda = getattr(mx, "cuda", None)
        on_cuda = cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
        return (AUTO_CUDA_BATCH if batch else AUTO_CUDA) if on_cuda else "fused"
    return how


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def window_widths() -> tuple:
    """The widths a batched verify window is padded up to (empty: its own).

    On a GPU a memory-bound forward costs about the same at 1 and 16 tokens,
    so a window padded to a few widths costs nothing more, holds more
    token-tree nodes (``RowTree.fill``) and meets fewer shapes (kernels and
    executable graphs built once each), up to ``PAD_TOKENS`` tokens a batch
    (``padded_width``); past that, and on a CPU, where each column costs
    compute, windows keep their width. MLX_LM_SPEC_WIDTHS (comma-separated,
    or ``off``) overrides."""
    how = os.environ.get("MLX_LM_SPEC_WIDTHS", "auto").strip().lower() or "auto"
    if how == "auto":
        return GPU_WIDTHS if _on_gpu() else ()
    if how == "off":
        return ()
    try:
        widths = tuple(sorted(int(w) for w in how.split(",")))
    except ValueError:
        widths = ()
    if not widths or widths[0] < 2:
        raise ValueError(f"MLX_LM_SPEC_WIDTHS: widths of 2 or more, 'off' or 'auto'; got {how!r}")
    return widths


def drafts_behind() -> bool:
    """Whether the serial loop queues a drafter's next drafts behind a
    verify before reading it (``VerifyLoop._draft_behind``), so that the
    device runs them while the host reads the verify and builds the next
    forward. Off unless MLX_LM_SPEC_BEHIND=on: on an H100 it read no
    faster (the host still builds every draft step, only earlier), and on
    a CPU the draft steps take the cores the host needs and a step a
    round does not use is lost."""
    how = os.environ.get("MLX_LM_SPEC_BEHIND", "off").strip().lower() or "off"
    if how not in ("on", "off"):
        raise ValueError(f"MLX_LM_SPEC_BEHIND must be on or off; got {how!r}")
    return how == "on"


def padded_width(width: int, widths: tuple, rows: int = 1) -> int:
    """``width`` padded up to the widest of ``widths`` at which the batch's
    ``rows`` windows hold at most ``PAD_TOKENS`` tokens (itself where none
    of them is that wide and fits): beyond that a forward's cost grows with
    its tokens, and padding would cost what it saves. The widest, not the
    next: a batch size then meets one width, each new (width, cache size)
    building its kernels and graphs on first use, and a round is a
    synchronous forward's price only once they are built (one padded
    width read faster than four on the H200:
    benchmarks/results/spec-decode-pipelined-h200.md)."""
    fits = [w for w in widths if width <= w and rows * w <= PAD_TOKENS]
    return max(fits) if fits else width


def flush_every() -> int:
    """Every how many layers a verify forward hands its graph to the device
    (``host.flush_layers``; 0: all at once). MLX_LM_SPEC_FLUSH overrides."""
    how = os.environ.get("MLX_LM_SPEC_FLUSH", "auto").strip().lower() or "auto"
    if how == "auto":
        return FLUSH_GPU if _on_gpu() else 0
    if how == "off":
        return 0
    if not how.isdigit():
        raise ValueError(f"MLX_LM_SPEC_FLUSH: a number of layers, 'off' or 'auto'; got {how!r}")
    return int(how)


def staged(model: Any, width: int, waited: bool = False) -> contextlib.AbstractContextManager:
    """The block's forward over ``width`` tokens flushed every ``flush_every()``
    layers: a verify forward, read back at once, whose graph the device would
    otherwise wait for in full. A one-token step is left as it is (behind a
    pipelined step the host builds the next while the device runs) unless
    ``waited``: nothing runs before it (a plain run's first step, after a
    round's read-back), so the device would idle while its graph is built."""
    return host.flush_layers(model, flush_every() if width > 1 or waited else 0)


def explicit_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Union[None, str, mx.array],
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` as matmuls (few queries):
    ``[B, Hq, L, D]`` queries over ``[B, Hkv, S, D]`` keys/values, grouped
    heads without copies, softmax in float32, masks as the fused op takes
    them (None, "causal", boolean or additive arrays)."""
    b, hq, n, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    q = (queries * scale).reshape(b, hkv, rep, n, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # [B, Hkv, rep, L, S]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = mx.arange(s)[None] <= (s - n + mx.arange(n))[:, None]
    if mask is not None:
        if mask.ndim == 4:
            mask = (
                mask.reshape(mask.shape[0], hkv, rep, n, s)
                if mask.shape[1] == hq and hq > 1
                else mx.expand_dims(mask, 2)
            )
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    w = mx.softmax(scores, axis=-1, precise=True)  # float32 inside, one kernel
    return (w @ mx.expand_dims(values, 2)).reshape(b, hq, n, d)


def filled(cache: Any) -> Optional[int]:
    """How many of ``cache``'s buffer entries its attention reads (a plain
    ``KVCache``'s offset, a batch cache's fill index), or ``None`` for caches
    whose buffer is not read in order (rotating, quantized)."""
    if type(cache) is KVCache:
        return cache.offset
    if isinstance(cache, BatchKVCache) and not hasattr(cache, "bits"):
        return cache._idx
    return None


def _keep(mask: Any, n: int, s: int, t: int, rows: int) -> Optional[mx.array]:
    """``[B|1, 1, rows, t]`` booleans over a cache buffer of ``t`` entries, the
    first ``s`` filled, for ``n`` queries under ``mask`` (None or "causal": the
    causal rule; a boolean ``[n, s]`` or ``[B, 1, n, s]`` array: as given).
    Query rows past ``n`` (padding, dropped) repeat the last row's; entries
    past ``s`` are hidden. ``None`` for masks the fused op's own path must take."""
    if mask is None or isinstance(mask, str):
        keep = mx.arange(t)[None] <= (s - n + mx.arange(rows))[:, None]
        return keep[None, None]
    if mask.dtype != mx.bool_ or mask.ndim not in (2, 4) or mask.shape[-2:] != (n, s):
        return None
    if mask.ndim == 4 and mask.shape[1] != 1:
        return None
    keep = mask.reshape(-1, 1, n, s)
    if rows > n:
        last = mx.broadcast_to(keep[:, :, -1:], (keep.shape[0], 1, rows - n, s))
        keep = mx.concatenate([keep, last], axis=2)
    if t > s:
        keep = mx.concatenate([keep, mx.zeros((keep.shape[0], 1, rows, t - s), mx.bool_)], axis=3)
    return keep


def padded_attention(
    queries: mx.array,
    cache: Any,
    scale: float,
    masks: Dict[tuple, Any],
    mask: Any = None,
    fused: bool = True,
) -> Optional[mx.array]:
    """Attention over ``cache``'s whole buffer (a plain or a batch KV cache),
    entries the window must not see hidden by an additive bias: the fused op
    (``fused``), else matmuls (``explicit_attention``). ``None`` where it does
    not apply. ``mask``: the forward's own (a batch's left padding and holes,
    a token tree's ancestors), else the causal rule. The shapes, and the
    kernels and graphs built for them, change only when the buffer grows
    (every 256 entries), not with every round's cache length. ``masks``
    keeps the bias for the forward's other layers: one dict per forward."""
    full_k, full_v, s = getattr(cache, "keys", None), getattr(cache, "values", None), filled(cache)
    if s is None or full_k is None or full_v is None or full_k.shape[2] < s:
        return None
    n, t = queries.shape[2], full_k.shape[2]
    # Query rows padded to a power of two (4, 8, 16): an adaptive draft
    # length then meets at most three graphs per buffer size, not fifteen.
    # Padding rows are zeros whose outputs are dropped.
    rows = max(4, 1 << (n - 1).bit_length())
    key = (id(mask) if isinstance(mask, mx.array) else None, n, s, t, queries.dtype)
    if key not in masks:
        keep = _keep(mask, n, s, t, rows)
        low = mx.array(mx.finfo(queries.dtype).min, queries.dtype)
        bias = None if keep is None else mx.where(keep, mx.array(0, queries.dtype), low)
        masks[key] = (mask, bias)  # the mask is held with its bias: its id stays its own
    bias = masks[key][1]
    if bias is None:
        return None
    q = queries
    if rows > n:
        b, h, _, d = queries.shape
        q = mx.concatenate([queries, mx.zeros((b, h, rows - n, d), queries.dtype)], axis=2)
    if fused:
        out = mx.fast.scaled_dot_product_attention(q, full_k, full_v, scale=scale, mask=bias)
    else:
        out = explicit_attention(q, full_k, full_v, scale, bias)
    return out[:, :, :n] if rows > n else out


@contextlib.contextmanager
def verify_attention(model: Any, width: int, policy: Optional[str] = None) -> Iterator[None]:
    """Within the block, the model's attention over ``width`` queries (2..16)
    runs as ``padded_attention`` (over the cache's buffer: fused, "padded",
    or matmuls, "buffer") or ``explicit_attention``, as ``policy`` (default:
    ``attention_policy()``) says; quantized caches, attention
    sinks and single queries keep mlx-lm's function."""
    policy = policy or attention_policy()
    if width < 2 or width > EXPLICIT_MAX_QUERIES or policy == "fused":
        yield
        return
    masks = {}  # one padding mask per forward, shared by its layers

    def patched(orig):
        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if (
                sinks is not None
                or hasattr(cache, "bits")
                or not 1 < queries.shape[2] <= EXPLICIT_MAX_QUERIES
            ):
                return orig(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            if policy in ("padded", "buffer") and keys.shape[2] == filled(cache):
                out = padded_attention(queries, cache, scale, masks, mask, policy == "padded")
                if out is not None:
                    return out
            return explicit_attention(queries, keys, values, scale, mask)

        return sdpa

    # The host swaps the function through its patch ledger for this forward only.
    with host.override_attention(model, patched):
        yield
