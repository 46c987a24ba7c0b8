"""Loss + hidden-state gradient of each GPU path, under ``mx.value_and_grad`` alone or compiled.

Shows what compiling the training step does to the pure-MLX path's block
step (benchmarks/results/flash-cce-h200.md, "Probe"):

    python plugins/flash-cce/scripts/compile_probe.py             # value_and_grad alone
    COMPILE=1 python plugins/flash-cce/scripts/compile_probe.py   # under mx.compile, as mlx_lm.lora
"""

import gc
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_lm_flash_cce import budget, linear_cross_entropy

N, V, H = 8192, 151936, 2048
k = mx.random.split(mx.random.key(0), 3)
h = mx.random.normal((N, H), key=k[0]).astype(mx.bfloat16)
w = (mx.random.normal((V, H), key=k[1]) * H**-0.5).astype(mx.bfloat16)
t = mx.random.randint(0, V, (N,), key=k[2])
mx.eval(h, w, t)

COMPILE = os.environ.get("COMPILE") == "1"


def run(name, fn, limit=None, reps=4):
    g = mx.value_and_grad(fn)
    if COMPILE:
        g = mx.compile(g)
    with budget.bounded(limit):
        ts = []
        for _ in range(reps + 1):
            gc.collect()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            out = g(h)
            mx.eval(out)
            mx.synchronize()
            ts.append(time.perf_counter() - tic)
            peak = mx.get_peak_memory() - base
            del out
    print(f"{name:50s} {1e3 * min(ts[1:]):7.1f} ms  {peak / 2**20:7.0f} MiB", flush=True)


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
