"""Backend dispatch: which implementation computes the per-token loss.

A backend is ``per_token(head, hidden, targets, opts, train) -> [N] float32``
(``hidden`` ``[N, H]``, ``targets`` ``[N]`` in range, ``head`` a
``heads.Head`` of kind dense or quantized, ``opts`` a
``portable.Options``, ``train`` which head parts get gradients) with
gradients for ``hidden`` and the head's trainable arrays. The public
call's ``backend="auto"`` measures the candidates (``autotune``);
``resolve("auto")`` here, the highest-priority available backend, serves
what the trial does not cover (a ``vocab_chunk`` set by the caller, a head
with a bias or LoRA, the gradient filters). The pure-MLX ``"mlx"`` backend
runs everywhere.
"""

from typing import Callable, Dict, List, Optional

import mlx.core as mx

from . import cuda, cuda_gemm, heads, portable

# The pure-MLX path's blocks on a GPU when the caller sets none: big enough
# that the device is not launch-bound (measured on the H200,
# benchmarks/results/flash-cce-h200.md).
GPU_TOKEN_CHUNK = 8192
GPU_VOCAB_CHUNK = 32768
BIG_BLOCK = 1 << 22  # token_chunk x vocab_chunk from which a GPU takes the one-pass big-block path

_REGISTRY = {}


def register(
    name: str,
    per_token: Callable[..., mx.array],
    *,
    available: Callable[[], bool] = lambda: True,
    priority: int = 0,
    supports: Callable[[heads.Head, portable.Options], bool] = lambda head, opts: True,
) -> None:
    """Add a backend; ``supports(head, opts)`` can decline some heads/options."""
    _REGISTRY[name] = {
        "per_token": per_token,
        "available": available,
        "priority": priority,
        "supports": supports,
    }


def names() -> List[str]:
    return sorted(_REGISTRY, key=lambda n: -_REGISTRY[n]["priority"])


def available() -> List[str]:
    out = []
    for name in names():
        try:
            if _REGISTRY[name]["available"]():
                out.append(name)
        except Exception:  # a backend probe that fails means "not here"
            pass
    return out


def supports(name: str, head: heads.Head, opts: portable.Options) -> bool:
    return _REGISTRY[name]["supports"](head, opts)


def big_blocks(name: str, head: heads.Head, opts: portable.Options) -> bool:
    """Does ``name`` run big blocks that need MLX's backpressure (``budget``) on this device?"""
    if mx.default_device() != mx.gpu or not cuda_gemm.supports(head, opts):
        return False
    if opts.filter_eps is not None or opts.block_skip_eps is not None:
        return False
    return not opts.vocab_chunk or opts.token_chunk * opts.vocab_chunk >= BIG_BLOCK


def mlx_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """The pure-MLX backend (MLX operations only, the path every GPU has).

    On the CPU: ``portable`` (small blocks; the CPU allocates only a few
    operations ahead). On a GPU: one pass in big blocks through
    ``cuda_gemm``'s structure with its compiled MLX step (no custom
    kernel), so that the device is not launch-bound: 8192 x 32768 blocks
    unless the caller sets ``vocab_chunk``. Heads with a bias or LoRA and
    the gradient filters stay on ``portable`` everywhere.
    """
    if not big_blocks("mlx", head, opts):
        return portable.per_token(head, hidden, targets, opts, train)
    if not opts.vocab_chunk:
        opts = opts._replace(token_chunk=GPU_TOKEN_CHUNK, vocab_chunk=GPU_VOCAB_CHUNK)
    if opts.elementwise not in ("mlx", "mlx-f32"):
        opts = opts._replace(elementwise="mlx")
    return cuda_gemm.per_token(head, hidden, targets, opts, train)


def resolve(name: str, head: heads.Head, opts: portable.Options) -> Callable[..., mx.array]:
    """The ``per_token`` function for ``name`` (or the best for ``"auto"``)."""
    if name != "auto":
        if name not in _REGISTRY:
            raise ValueError(f"unknown flash-cce backend {name!r} (have: {', '.join(names())})")
        if name not in available():
            raise ValueError(f"flash-cce backend {name!r} is not available on this machine")
        return _REGISTRY[name]["per_token"]
    for candidate in available():
        entry = _REGISTRY[candidate]
        if entry["supports"](head, opts):
            return entry["per_token"]
    raise ValueError("no flash-cce backend supports this head")  # "mlx" supports all


register("mlx", mlx_per_token, priority=0)
register("cuda", cuda.per_token, available=cuda.available, priority=10, supports=cuda.supports)
# Big cuBLAS blocks (``cuda_gemm``): runs anywhere; ``auto`` reaches it
# through its trial (``autotune``), never by priority.
register(
    "cuda-gemm",
    cuda_gemm.per_token,
    available=cuda_gemm.available,
    priority=-1,
    supports=cuda_gemm.supports,
)
