"""The target model split into backbone and lm-head, for drafters that read
its last hidden state (``Drafter.needs_hidden``)."""

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache

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
# times a plain step: benchmarks/results/spec-decode-h200.md). A window of a few
# queries needs no fused kernel, so the loop's verify forwards run attention
# as plain matmuls there ("explicit"), or ("padded") through the fused op
# over the cache's whole preallocated buffer (a multiple of 256 rows) with
# an additive mask, so that the shape, and the cuDNN graph, only change
# every 256 tokens. MLX_LM_SPEC_ATTENTION=fused|explicit|padded|auto
# overrides the choice (auto: padded on a CUDA GPU).
EXPLICIT_MAX_QUERIES = 16
POLICIES = ("auto", "fused", "explicit", "padded")
AUTO_CUDA = "padded"
GPU_WIDTHS = (4, 8, 12, 16)
PAD_TOKENS = 16  # the most window tokens a batch is padded up to
FLUSH_GPU = 5  # a verify forward's layers per flush on a GPU (host.flush_layers)


def attention_policy() -> str:
    how = os.environ.get("MLX_LM_SPEC_ATTENTION", "auto").strip().lower() or "auto"
    if how not in POLICIES:
        raise ValueError(f"MLX_LM_SPEC_ATTENTION must be one of {', '.join(POLICIES)}, got {how!r}")
    if how == "auto":
        cuda = getattr(mx, "cuda", None)
        on_cuda = cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
        return AUTO_CUDA if on_cuda else "fused"
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


def staged(model: Any, width: int) -> contextlib.AbstractContextManager:
    """The block's forward over ``width`` tokens flushed every ``flush_every()``
    layers: a verify forward, read back at once, whose graph the device would
    otherwise wait for in full. A one-token step is left as it is: behind a
    pipelined step the host builds the next while the device runs."""
    return host.flush_layers(model, flush_every() if width > 1 else 0)


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


def padded_attention(
    queries: mx.array,
    cache: Any,
    scale: float,
    masks: Dict[tuple, mx.array],
    window: Optional[mx.array] = None,
) -> Optional[mx.array]:
    """The fused op over ``cache``'s whole buffer (``KVCache`` only), rows
    past the window's causal limit masked; ``None`` where it does not apply.
    ``window`` (``[n, n]`` booleans, a token tree's ancestors) replaces the
    causal rule inside the window: the same shapes, so the same graphs, as
    a chain of its width. ``masks`` keeps the bias for the forward's other
    layers: one dict per forward, which feeds one window."""
    full_k, full_v = getattr(cache, "keys", None), getattr(cache, "values", None)
    if type(cache) is not KVCache or full_k is None or full_v is None:
        return None
    n, s, t = queries.shape[2], cache.offset, full_k.shape[2]
    if t < s:
        return None
    # Query rows padded to a power of two (4, 8, 16): an adaptive draft
    # length then meets at most three graphs per buffer size, not fifteen.
    # Padding rows are zeros whose outputs are dropped.
    rows = max(4, 1 << (n - 1).bit_length())
    key = (n, s, t, queries.dtype, window is None)
    bias = masks.get(key)
    if bias is None:
        if window is None:
            keep = mx.arange(t)[None] <= (s - n + mx.arange(rows))[:, None]
        else:
            inside = mx.concatenate([window, mx.ones((rows - n, n), mx.bool_)])
            keep = mx.concatenate(
                [mx.ones((rows, s - n), mx.bool_), inside, mx.zeros((rows, t - s), mx.bool_)],
                axis=1,
            )
        low = mx.array(mx.finfo(queries.dtype).min, queries.dtype)
        bias = masks[key] = mx.where(keep, mx.array(0, queries.dtype), low)[None, None]
    q = queries
    if rows > n:
        b, h, _, d = queries.shape
        q = mx.concatenate([queries, mx.zeros((b, h, rows - n, d), queries.dtype)], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, full_k, full_v, scale=scale, mask=bias)
    return out[:, :, :n] if rows > n else out


@contextlib.contextmanager
def verify_attention(model: Any, width: int, policy: Optional[str] = None) -> Iterator[None]:
    """Within the block, the model's attention over ``width`` queries (2..16)
    runs as ``padded_attention`` or ``explicit_attention``, as ``policy``
    (default: ``attention_policy()``) says; quantized caches, attention
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
            if (
                policy == "padded"
                and (mask is None or isinstance(mask, str))
                and keys.shape[2] == cache.offset
            ):
                out = padded_attention(queries, cache, scale, masks)
                if out is not None:
                    return out
            return explicit_attention(queries, keys, values, scale, mask)

        return sdpa

    # The host swaps the function through its patch ledger for this forward only.
    with host.override_attention(model, patched):
        yield
