"""Loss + hidden-state gradient of each GPU path, under ``mx.value_and_grad`` alone or compiled.

Shows what compiling the training step does to the pure-MLX path's block
step (benchmarks/results/flash-cce-h200.md, "Probe"):

    python plugins/flash-cce/scripts/compile_probe.py             # value_and_grad alone
    COMPILE=1 python plugins/flash-cce/scripts/compile_probe.py   # under mx.compile, as mlx_lm.lora
    SHAPE=NxVxH ...                                               # another shape (default 8192x151936x2048)
"""

import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "plugins" / "flash-cce"), str(ROOT / "benchmarks")]
import common  # noqa: E402  (the benchmarks' loss + gradient loop)

from mlx_lm_flash_cce import budget, linear_cross_entropy  # noqa: E402

N, V, H = (int(x) for x in os.environ.get("SHAPE", "8192x151936x2048").split("x"))
k = mx.random.split(mx.random.key(0), 3)
h = mx.random.normal((N, H), key=k[0]).astype(mx.bfloat16)
w = (mx.random.normal((V, H), key=k[1]) * H**-0.5).astype(mx.bfloat16)
t = mx.random.randint(0, V, (N,), key=k[2])
mx.eval(h, w, t)
print(common.header_line(), flush=True)

COMPILE = os.environ.get("COMPILE") == "1"


def run(name, fn, limit=None, reps=4):
    with budget.bounded(limit):
        t, peak, _ = common.grad_cost(fn, [h], repeats=reps, warmup=1, compiled=COMPILE)
    print(f"{name:50s} {1e3 * t.min:7.1f} ms  {peak / 2**20:7.0f} MiB (min of {reps})", flush=True)


run("stock", lambda x: nn.losses.cross_entropy(x @ w.T, t, reduction="mean"))
for be, el in (("cuda-gemm", "kernel"), ("mlx", "mlx")):
    for vc in (16384, 32768):
        for lim in (None, 1024 << 20):

            def f(x, be=be, vc=vc, el=el):
                return linear_cross_entropy(
                    x, w, t, backend=be, token_chunk=8192, vocab_chunk=vc, elementwise=el
                )

            try:
                run(f"{be} el={el} 8192x{vc} limit={lim and lim >> 20}", f, lim)
            except Exception as e:
                print(be, el, vc, lim, "failed", type(e).__name__, str(e)[:200])
