"""The plain data of the path choice: the paths, a candidate, its measurement, a choice."""

import enum
from typing import NamedTuple

MIB = 1 << 20


class Path(str, enum.Enum):
    """Every computation of the loss head; each runs only itself (``backends``)."""

    STOCK = "stock"  # the full [N, V] logits and mlx-lm's cross-entropy (logits.py)
    CHUNKED = "chunked"  # a callable head, token chunk by token chunk (logits.py)
    MLX = "mlx"  # pure MLX, one pass per token chunk in small blocks (portable.py)
    MLX_BLOCKS = "mlx-blocks"  # pure MLX, one pass in big blocks, compiled MLX step (cuda_gemm.py)
    CUDA_GEMM = "cuda-gemm"  # the same big blocks with the CUDA row kernel (cuda_gemm.py, rows.py)
    CUDA = "cuda"  # the fused CUDA kernels (cuda.py)

    def __str__(self) -> str:
        return self.value


FLASH = (Path.MLX, Path.MLX_BLOCKS, Path.CUDA_GEMM, Path.CUDA)  # never hold [N, V]

# Big-block configurations for a GPU: (tokens, vocabulary rows, limit MiB
# above the inputs): the fastest, and the one of least memory, from the
# H200 runs in benchmarks/results/flash-cce-h200.md; each configuration the
# trial runs costs kernel compiles, so there are two.
GPU_BLOCKS = ((8192, 32768, 1024), (2048, 8192, 128))


class Candidate(NamedTuple):
    path: Path
    token_chunk: int = 0  # 0: the path's own blocks
    vocab_chunk: int = 0
    limit_mib: int = 0  # mx.set_memory_limit headroom above the inputs (0: none)
    last_resort: bool = False  # tried only when nothing else fits the budget

    @property
    def label(self) -> str:
        out = self.path.value
        if self.vocab_chunk:
            out += f" {self.token_chunk}x{self.vocab_chunk}"
        if self.limit_mib:
            out += f" +{self.limit_mib}M"
        return out

    def as_dict(self) -> dict:
        return dict(self._asdict(), path=self.path.value)


class Result(NamedTuple):
    candidate: Candidate
    ms: float
    peak: int  # bytes above the inputs


class Choice(NamedTuple):
    candidate: Candidate
    ms: float
    peak: int
    line: str  # the log line of the decision that made it
