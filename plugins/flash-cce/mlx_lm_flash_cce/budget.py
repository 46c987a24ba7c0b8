"""The loss head's memory budget, and MLX's backpressure that keeps to it.

``--cce-memory-budget SIZE`` (``linear_cross_entropy(memory_budget=)``) is
the most working memory the loss head may use above its inputs: the
measuring choice (``autotune``) only keeps a path whose measured peak fits it.

On an asynchronous GPU (CUDA, Metal) MLX queues work ahead of the device
and frees a block's buffers only when the device is done with it, so a
loop over blocks alone does not bound memory. MLX's own backpressure does:
above ``mx.set_memory_limit`` the evaluator waits for queued work before it
allocates more. ``MemoryLimit`` sets that limit once, the first time a
training loss needs it, and restores the old one when the plugin is
deactivated (the end of ``mlx_lm.lora``) or ``release()`` is called.
"""

import contextlib
import logging
import re
from typing import Iterator, Optional, Union

import mlx.core as mx

log = logging.getLogger("mlx_lm_flash_cce")

MIB = 1 << 20
# The default budget: half of what the stock head would hold for the batch,
# at most DEFAULT_CAP. Chosen from the H200 measurements in
# benchmarks/results/flash-cce-h200.md (the README's "Memory budget" says why).
DEFAULT_CAP = 2048 * MIB
DEFAULT_FLOOR = 256 * MIB
DEFAULT_SHARE = 0.5
# With the default budget, a training run holds MLX's limit no lower than
# this share of the device's working set (see MemoryLimit).
DEVICE_SHARE = 0.75
# No path runs in less (a few blocks and the [tokens, hidden] accumulators).
MIN_BUDGET = 1 * MIB

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: Union[int, float, str]) -> int:
    """Bytes in ``"512M"``, ``"1.5G"``, ``"64K"`` or ``"1048576"`` (K/M/G are powers of 1024)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a memory size cannot be negative, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (want e.g. 512M, 2G, 1.5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: float) -> str:
    """``2G``, ``1536M``, ``97M``: the shortest exact-enough spelling, rounded up to MiB."""
    mib = -(-int(nbytes) // MIB)
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}G"
    return f"{mib}M"


def default_for(stock_bytes: int) -> int:
    """The default budget for a batch whose stock head needs ``stock_bytes``."""
    return max(DEFAULT_FLOOR, min(DEFAULT_CAP, int(stock_bytes * DEFAULT_SHARE)))


def device_floor() -> int:
    """``DEVICE_SHARE`` of the device's recommended working set (or of its memory)."""
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001
        return 0
    total = (
        info.get("max_recommended_working_set_size")
        or info.get("memory_size")
        or info.get("total_memory")
        or 0
    )
    return int(DEVICE_SHARE * total)


def resolve(budget: Union[int, float, str, None]) -> Optional[int]:
    """The budget in bytes (None: the default, ``default_for`` the batch); below ``MIN_BUDGET`` is an error."""
    if budget is None:
        return None
    nbytes = parse_size(budget)
    if nbytes < MIN_BUDGET:
        raise ValueError(
            f"memory budget {budget!r} is below what any flash-cce path needs "
            f"(at least {format_size(MIN_BUDGET)})"
        )
    return nbytes


def is_async_gpu() -> bool:
    """A GPU default device: evaluation runs ahead of the device (CUDA, Metal)."""
    return mx.default_device() == mx.gpu


@contextlib.contextmanager
def bounded(extra_bytes: Optional[int]) -> Iterator[None]:
    """``mx.set_memory_limit(active + extra_bytes)`` for a ``with`` block (None: nothing)."""
    if not extra_bytes:
        yield
        return
    old = mx.set_memory_limit(int(mx.get_active_memory() + extra_bytes))
    try:
        yield
    finally:
        mx.set_memory_limit(old)


class MemoryLimit:
    """``mx.set_memory_limit`` held for a training run, restored by ``release()``.

    ``hold(extra, floor)`` sets the limit to the memory active now plus
    ``extra``, and no lower than ``floor`` (called when the loss is first
    built, with the model and optimizer state resident); a later ``hold``
    only ever raises it. The model's activations count against the limit
    too: while they sit above it MLX runs the queued work before each new
    allocation. That keeps the loss blocks from piling up, and also makes
    the model's own backward pass wait for the device op by op: a whole
    LoRA step took markedly longer with the limit at weights + the path's
    headroom (benchmarks/results/flash-cce-h200.md). So the default budget holds it no lower than
    ``device_floor()`` (a step runs unthrottled until memory gets short),
    and an explicit ``--cce-memory-budget`` holds it at weights + budget.
    """

    def __init__(self) -> None:
        self.old: Optional[int] = None
        self.limit: Optional[int] = None

    def hold(self, extra_bytes: int, floor: int = 0) -> int:
        want = max(int(mx.get_active_memory() + extra_bytes), floor)
        if self.limit is not None and want <= self.limit:
            return self.limit
        previous = mx.set_memory_limit(want)
        if self.old is None:
            self.old = previous
        self.limit = want
        log.debug("flash-cce: memory limit %s (was %s)", format_size(want), format_size(self.old))
        return want

    def release(self) -> None:
        if self.old is not None:
            mx.set_memory_limit(self.old)
            log.debug("flash-cce: memory limit restored to %s", format_size(self.old))
        self.old = self.limit = None


LIMIT = MemoryLimit()  # the one the plugin holds around `mlx_lm.lora`
