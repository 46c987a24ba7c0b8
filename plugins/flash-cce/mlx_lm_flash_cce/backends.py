"""The registry of paths: what each ``Path`` runs, where it runs and which calls it takes.

A path is ``per_token(head, hidden, targets, opts, train) -> [N] float32``
(``hidden`` ``[N, H]``, ``targets`` ``[N]`` in range, ``head`` a
``heads.Head``, ``opts`` a ``portable.Options``, ``train`` which head parts
get gradients) with gradients for ``hidden`` and the head's trainable
arrays. Each entry also says whether the path runs on this machine
(``available``) and why it cannot take a call (``refuses``: a reason, or
None). A path never hands a call it refuses to another: choosing is
``selection.select``'s job, the only reader of this registry.
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from . import cuda, cuda_gemm, heads, logits, portable
from .candidate import FLASH, Path

# The big-block paths' blocks when the caller sets none: big enough that a
# GPU is not launch-bound (benchmarks/results/flash-cce-h200.md).
GPU_TOKEN_CHUNK = 8192
GPU_VOCAB_CHUNK = 32768
BIG_BLOCK = 1 << 22  # token_chunk x vocab_chunk from which a GPU needs MLX's backpressure


class Entry(NamedTuple):
    per_token: Callable[..., mx.array]
    available: Callable[[], bool]
    refuses: Callable[[heads.Head, mx.array, portable.Options], Optional[str]]


def _blocks_refuse(head, hidden, opts):
    """Why the one-pass big-block structure cannot take this call (None: it can)."""
    if head.kind not in ("dense", "quantized"):
        return f"a {head.kind} head (it needs a weight to slice)"
    if head.bias is not None:
        return "a head with an output bias"
    if head.has_lora:
        return "LoRA on the head"
    if opts.filter_eps is not None or opts.block_skip_eps is not None:
        return "the gradient filters (filter_eps / block_skip_eps)"
    return None


def _flash_refuses(head, hidden, opts):
    if head.kind == "module":
        return (
            f"a head given only as a callable ({type(head.module).__name__}) has no rows "
            "to slice (use 'chunked' or 'auto')"
        )
    return None


def _chunked_refuses(head, hidden, opts):
    if not callable(head.module):
        return "a head given as a weight array has no callable to run on chunks"
    return None


def _kernel_refuses(head, hidden, opts):
    why = _blocks_refuse(head, hidden, opts)
    if why is None and not cuda_gemm.on_cuda():
        why = (
            "no CUDA GPU as the default device ('mlx-blocks' runs the same blocks with MLX's step)"
        )
    if why is None and portable.compute_dtype(opts, hidden.dtype) not in cuda_gemm.KERNEL_DTYPES:
        why = f"hidden dtype {hidden.dtype}"
    if why is None and cuda_gemm.row_kernel() is None:
        why = "its row kernel does not compile here (NVRTC not found)"
    return why


def _cuda_refuses(head, hidden, opts):
    if not cuda.available():
        return "no CUDA GPU as the default device"
    return cuda.unsupported(head, hidden)


def mlx_blocks_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Path ``mlx-blocks``: ``cuda_gemm``'s one pass with its compiled MLX step (no kernel).

    Blocks as ``mlx_blocks_options`` sets them; ``opts.elementwise="mlx-f32"``
    takes the float32 variant of the step.
    """
    opts = mlx_blocks_options(opts)
    step = "mlx-f32" if opts.elementwise == "mlx-f32" else "mlx"
    return cuda_gemm.per_token(head, hidden, targets, opts._replace(elementwise=step), train)


def mlx_blocks_options(opts: portable.Options) -> portable.Options:
    """``opts`` as path ``mlx-blocks`` runs them: 8192 x 32768 blocks unless ``vocab_chunk`` is set."""
    if opts.vocab_chunk:
        return opts
    return opts._replace(token_chunk=GPU_TOKEN_CHUNK, vocab_chunk=GPU_VOCAB_CHUNK)


def blocks(path: Path, opts: portable.Options, n_tok: int, vocab: int) -> Tuple[int, int]:
    """``(token_chunk, vocab_chunk)``: the blocks flash ``path`` runs ``n_tok`` tokens in."""
    if path is Path.MLX:
        return portable.vocab_chunk_for(opts, n_tok, vocab)
    if path is Path.MLX_BLOCKS:
        opts = mlx_blocks_options(opts)
    if path in (Path.MLX_BLOCKS, Path.CUDA_GEMM):
        return cuda_gemm.blocks(opts, n_tok, vocab)
    raise ValueError(f"path {path.value!r} does not work in blocks")


def cuda_gemm_per_token(
    head: heads.Head,
    hidden: mx.array,
    targets: mx.array,
    opts: portable.Options,
    train: Optional[Dict[str, bool]] = None,
) -> mx.array:
    """Path ``cuda-gemm``: the big blocks with the CUDA row kernel (8192 x 8192 by default)."""
    return cuda_gemm.per_token(head, hidden, targets, opts._replace(elementwise="kernel"), train)


_always = lambda: True  # noqa: E731

REGISTRY: Dict[Path, Entry] = {
    Path.STOCK: Entry(logits.stock_path, _always, lambda head, hidden, opts: None),
    Path.CHUNKED: Entry(logits.chunked_path, _always, _chunked_refuses),
    Path.MLX: Entry(portable.per_token, _always, _flash_refuses),
    Path.MLX_BLOCKS: Entry(mlx_blocks_per_token, _always, _blocks_refuse),
    Path.CUDA_GEMM: Entry(cuda_gemm_per_token, cuda_gemm.on_cuda, _kernel_refuses),
    Path.CUDA: Entry(cuda.per_token, cuda.available, _cuda_refuses),
}


def names() -> List[str]:
    """Every flash path's name (what ``--cce-backend`` takes besides ``auto``)."""
    return [p.value for p in FLASH]


def available() -> List[str]:
    """The flash paths this machine runs at all (a call may still be refused)."""
    out = []
    for path in FLASH:
        try:
            if REGISTRY[path].available():
                out.append(path.value)
        except Exception:  # noqa: BLE001 (a probe that fails means "not here")
            pass
    return out


def refuses(
    path: Path, head: heads.Head, hidden: mx.array, opts: portable.Options
) -> Optional[str]:
    """Why ``path`` cannot run this call here (None: it can)."""
    entry = REGISTRY[path]
    if path.value not in available() and path in FLASH:
        return entry.refuses(head, hidden, opts) or "not available on this machine"
    return entry.refuses(head, hidden, opts)


def per_token(path: Path) -> Callable[..., mx.array]:
    return REGISTRY[path].per_token
