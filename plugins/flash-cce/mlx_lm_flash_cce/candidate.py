"""The plain data of ``backend="auto"``: a candidate path, its measurement, a choice."""

from typing import NamedTuple

MIB = 1 << 20
# Big-block configurations for a GPU: (tokens, vocabulary rows, limit MiB
# above the inputs): the fastest, and the one of least memory. On the H200
# (benchmarks/results/flash-cce-h200.md, compiled as in training) 8192 x
# 32768 was faster than 8192 x 16384 with both steps and needed less memory
# with the MLX step; each configuration the trial runs costs kernel compiles.
GPU_BLOCKS = ((8192, 32768, 1024), (2048, 8192, 128))


class Candidate(NamedTuple):
    impl: str  # "stock" | "flash"
    backend: str = ""  # flash backend: "mlx", "cuda-gemm", "cuda"
    token_chunk: int = 0  # 0: the backend's own blocks
    vocab_chunk: int = 0
    limit_mib: int = 0  # mx.set_memory_limit headroom above the inputs (0: none)
    last_resort: bool = False  # tried only when nothing else fits the budget

    @property
    def label(self) -> str:
        if self.impl == "stock":
            return "stock"
        out = self.backend
        if self.vocab_chunk:
            out += f" {self.token_chunk}x{self.vocab_chunk}"
        if self.limit_mib:
            out += f" +{self.limit_mib}M"
        return out


class Result(NamedTuple):
    candidate: Candidate
    ms: float
    peak: int  # bytes above the inputs


class Choice(NamedTuple):
    candidate: Candidate
    ms: float
    peak: int
    line: str  # the log line of the trial that made it
