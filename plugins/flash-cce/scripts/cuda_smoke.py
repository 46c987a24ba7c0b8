"""First look at the fused CUDA kernels on a GPU: errors per stage, one timing.

Prints, for a few shapes and heads, the kernels' per-token loss error, the
log-sum-exp error, and the hidden-gradient error against float32 math, so
that a wrong kernel shows which half is wrong. Run on the device machine:

    python plugins/flash-cce/scripts/cuda_smoke.py
"""

import time

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_flash_cce import cuda


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(((a - b) ** 2).sum()) / mx.maximum(mx.sqrt((b**2).sum()), 1e-30)).item()


def case(n, v, h, dtype=mx.bfloat16, bits=0, group=64, seed=0, softcap=None):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    hidden = mx.random.normal((n, h), key=k1).astype(dtype)
    weight = (3 * mx.random.normal((v, h), key=k2) / h**0.5).astype(dtype)
    targets = mx.random.randint(0, v, (n,), key=k3).astype(mx.int32)
    g = mx.random.uniform(0.5, 1.5, (n,), key=k4)
    if bits:
        q = mx.quantize(weight, group_size=group, bits=bits)
        w32 = mx.dequantize(*q, group_size=group, bits=bits).astype(mx.float32)
        vals = list(q)
    else:
        w32 = weight.astype(mx.float32)
        vals = [weight]
    cfg = cuda.Config(
        quantized=bool(bits),
        bits=bits,
        scale=1.0,
        softcap=softcap or 0.0,
        filter_eps=0.0,
        block_skip_eps=0.0,
        train_weight=False,
    )
    ce, lse = cuda.forward(cfg, hidden, targets, vals)
    dh = cuda.backward(cfg, hidden, targets, lse, g, vals)
    mx.eval(ce, lse, dh)

    x = hidden.astype(mx.float32)
    z = x @ w32.T
    if softcap:
        z = softcap * mx.tanh(z / softcap)
    lse_ref = mx.logsumexp(z, axis=1)
    ce_ref = nn.losses.cross_entropy(z, targets)
    dh_ref = mx.grad(
        lambda x: (
            g
            * nn.losses.cross_entropy(
                (softcap * mx.tanh((x @ w32.T) / softcap)) if softcap else x @ w32.T, targets
            )
        ).sum()
    )(x)
    mx.eval(lse_ref, ce_ref, dh_ref)
    tag = f"N={n} V={v} H={h} {dtype} {f'q{bits}/g{group}' if bits else 'dense'}" + (
        f" softcap={softcap}" if softcap else ""
    )
    print(
        f"{tag:>44}: lse {rel(lse, lse_ref):.2e}  ce {rel(ce, ce_ref):.2e}  dh {rel(dh, dh_ref):.2e}  "
        f"nan {bool(mx.isnan(dh).any().item() or mx.isnan(ce).any().item())}",
        flush=True,
    )


def timing(n, v, h, bits=0):
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(mx.bfloat16)
    weight = (mx.random.normal((v, h), key=k2) / h**0.5).astype(mx.bfloat16)
    targets = mx.random.randint(0, v, (n,), key=k3).astype(mx.int32)
    vals = list(mx.quantize(weight, group_size=64, bits=bits)) if bits else [weight]
    cfg = cuda.Config(
        quantized=bool(bits),
        bits=bits,
        scale=1.0,
        softcap=0.0,
        filter_eps=0.0,
        block_skip_eps=0.0,
        train_weight=False,
    )
    g = mx.full((n,), 1.0 / n)
    mx.eval(hidden, vals, targets)
    out = {}
    for name in ("fwd", "bwd", "bwd"):
        tic = time.perf_counter()
        if name == "fwd":
            ce, lse = cuda.forward(cfg, hidden, targets, vals)
            mx.eval(ce, lse)
        else:
            mx.eval(cuda.backward(cfg, hidden, targets, lse, g, vals))
        mx.synchronize()
        out[name] = time.perf_counter() - tic
    for _ in range(2):
        tic = time.perf_counter()
        ce, lse = cuda.forward(cfg, hidden, targets, vals)
        mx.eval(ce, lse)
        mx.synchronize()
        t1 = time.perf_counter()
        mx.eval(cuda.backward(cfg, hidden, targets, lse, g, vals))
        mx.synchronize()
        t2 = time.perf_counter()
        out["fwd"], out["bwd"] = min(out["fwd"], t1 - tic), min(out["bwd"], t2 - t1)
    flops = 2 * n * v * h
    print(
        f"timing N={n} V={v} H={h} {f'q{bits}' if bits else 'bf16'}: fwd {out['fwd'] * 1e3:.1f} ms "
        f"({flops / out['fwd'] / 1e12:.0f} TFLOP/s), bwd {out['bwd'] * 1e3:.1f} ms "
        f"({2 * flops / out['bwd'] / 1e12:.0f} TFLOP/s); splits fwd {cuda.fwd_splits(n, v)} "
        f"bwd {cuda.bwd_splits(n, v)}",
        flush=True,
    )


def sweep(n=8192, v=151936, h=2048, bits=0):
    """Time the kernels at several vocabulary-split counts (grid shapes)."""
    fwd0, bwd0 = cuda.fwd_splits, cuda.bwd_splits
    try:
        for s in (2, 4, 9, 17):
            cuda.fwd_splits = lambda n_, v_, s=s: s
            cuda.bwd_splits = lambda n_, v_: 4
            timing(n, v, h, bits)
        for s in (1, 2, 3, 6, 8):
            cuda.fwd_splits = fwd0
            cuda.bwd_splits = lambda n_, v_, s=s: s
            timing(n, v, h, bits)
    finally:
        cuda.fwd_splits, cuda.bwd_splits = fwd0, bwd0


if __name__ == "__main__":
    import sys

    print(
        "mlx", mx.__version__, mx.default_device(), "cuda available:", cuda.available(), flush=True
    )
    if "--sweep" in sys.argv:
        sweep()
        sys.exit(0)
    tic = time.perf_counter()
    case(300, 5003, 256)
    print(f"  (first call, with compilation: {time.perf_counter() - tic:.1f} s)")
    case(1, 300, 128)
    case(77, 1000, 192, mx.float16)
    case(513, 2049, 576)
    case(200, 4099, 192, softcap=5.0)
    case(300, 3001, 256, bits=4, group=64)
    case(300, 3001, 256, bits=8, group=128)
    case(129, 3001, 256, mx.float16, bits=4, group=32)
    timing(8192, 151936, 2048)
    timing(8192, 151936, 2048, bits=4)
