"""Backend dispatch: which implementation computes the per-token loss.

A backend is ``per_token(head, hidden, targets, opts, train) -> [N] float32``
(``hidden`` ``[N, H]``, ``targets`` ``[N]`` in range, ``head`` a
``heads.Head`` of kind dense or quantized, ``opts`` a
``portable.Options``, ``train`` which head parts get gradients) with
gradients for ``hidden`` and the head's trainable arrays. ``"auto"`` picks the available backend of highest
priority; the pure-MLX ``"mlx"`` backend runs everywhere. A fused kernel
(for example CUDA) registers itself here and takes over on its hardware
without changing the public call.
"""

from . import cuda, cuda_gemm, portable

_REGISTRY = {}


def register(name, per_token, *, available=lambda: True, priority=0, supports=lambda head, opts: True):
    """Add a backend; ``supports(head, opts)`` can decline some heads/options."""
    _REGISTRY[name] = {
        "per_token": per_token,
        "available": available,
        "priority": priority,
        "supports": supports,
    }


def names():
    return sorted(_REGISTRY, key=lambda n: -_REGISTRY[n]["priority"])


def available():
    out = []
    for name in names():
        try:
            if _REGISTRY[name]["available"]():
                out.append(name)
        except Exception:  # a backend probe that fails means "not here"
            pass
    return out


def resolve(name, head, opts):
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


register("mlx", portable.per_token, priority=0)
register("cuda", cuda.per_token, available=cuda.available, priority=10, supports=cuda.supports)
# Big cuBLAS blocks (``cuda_gemm``): runs anywhere, but only on request until
# an H200 run shows whether it beats the fused kernels there (then raise
# its priority on CUDA); below "mlx" so that "auto" never picks it.
register("cuda-gemm", cuda_gemm.per_token, available=cuda_gemm.available, priority=-1,
         supports=cuda_gemm.supports)
