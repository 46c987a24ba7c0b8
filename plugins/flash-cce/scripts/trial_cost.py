"""What auto's trial costs in a fresh process, against a training step's loss head.

Runs ``linear_cross_entropy`` (backend ``auto``) once on a synthetic batch
with no cached choice, so the trial runs, and prints its log line and the
seconds of that first call and of a later, compiled call (loss and
gradient, as a training step runs the head). The flash-cce cache folder
(``$MLX_LM_FLASH_CCE_CACHE``, else a new temporary one) keeps its compiled
kernels; only its choices are removed. Run it twice: the first process on a
machine also pays the kernel compiles (MLX's, kept in MLX's PTX cache, and
flash-cce's row kernel), the second finds them on disk.

    python plugins/flash-cce/scripts/trial_cost.py --shape 8192x151936x2048 [--q4] [--budget 2G]
"""

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm_flash_cce import autotune, linear_cross_entropy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192x151936x2048", help="NxVxH")
    p.add_argument("--q4", action="store_true", help="a 4-bit head")
    p.add_argument("--budget", default=None, help="--cce-memory-budget (default: the default)")
    p.add_argument(
        "--backend",
        default="auto",
        help="a backend to force instead (its first call, against auto's, is auto's extra cost)",
    )
    a = p.parse_args()
    n, v, h = (int(x) for x in a.shape.split("x"))
    if not os.environ.get(autotune.CACHE_ENV):
        os.environ[autotune.CACHE_ENV] = tempfile.mkdtemp()
    autotune.cache_path().unlink(missing_ok=True)  # no cached choice: the trial runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("TRIAL_DEBUG"):  # each candidate's calls, and what the trial skipped
        logging.getLogger("mlx_lm_flash_cce").setLevel(logging.DEBUG)
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(mx.bfloat16)
    weight = (mx.random.normal((v, h), key=k2) * h**-0.5).astype(mx.bfloat16)
    targets = mx.random.randint(0, v, (n,), key=k3)
    head = weight
    if a.q4:
        head = nn.QuantizedLinear(h, v, bias=False, group_size=64, bits=4)
        head.weight, head.scales, head.biases = mx.quantize(weight, group_size=64, bits=4)
    mx.eval(hidden, targets, head if not a.q4 else head.parameters())

    def loss(x):
        return linear_cross_entropy(
            x, head, targets, train={"weight": False}, memory_budget=a.budget, backend=a.backend
        )

    step = mx.compile(mx.value_and_grad(loss))
    tic = time.perf_counter()
    mx.eval(step(hidden))  # the trial, then this call's own compile and run
    mx.synchronize()
    first = time.perf_counter() - tic
    times = []
    for _ in range(3):
        tic = time.perf_counter()
        mx.eval(step(hidden))
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    what = "trial + compile + run" if a.backend == "auto" else f"{a.backend}: compile + run"
    print(f"first call ({what}) {first:.2f} s; loss head + gradient {min(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
