"""flash-cce vs mlx-lm's stock loss: peak memory and time, in one run.

Sections (pick with flags; default: --heads):

--heads       loss + hidden-state gradient of the loss head alone (frozen
              head, as in LoRA training) at (N, V) = (2048, 49152),
              (8192, 151936), (8192, 262144). Peak memory is
              ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``, minus
              the memory held before the call (hidden, head, targets), so it
              is the loss head's own working memory.
--step        one whole `mlx_lm.lora`-style training step (the trainer's
              compiled step, LoRA, Adam) on the real SmolLM2-135M with each
              loss, each in a fresh process.
--crossover   loss + gradient time for short inputs: where the stock-style
              head stops being faster (sets api.MIN_FLASH_ELEMENTS).
--gpu-table   (CUDA) the fused kernels vs the stock loss vs the pure-MLX
              path vs the cuda-gemm backend (big cuBLAS blocks; block sizes
              and memory limits from --gemm-configs): ms and peak MiB of
              loss + hidden-state gradient (frozen head) at (N, V, H) =
              (8192, 151936, 2048), (8192, 262144, 2560), (8192, 151936,
              4096), bf16 dense and 4-bit heads, plus the fused forward alone.
--auto-table  (GPU or CPU) ONE table per run: each path of the loss head
              (stock, pure-MLX in big blocks with the lean / float32 step,
              cuda-gemm, fused cuda) and what ``backend="auto"`` picks at
              each budget (its trial time too), bf16 and 4-bit heads,
              ratios against stock measured in the same run.
--step        (with --step-model random-llama-1b on a GPU: a ~1B llama with
              random bf16 weights, V=151936, batch 4 x 2048)
--filters     gradient error and time of the approximate options
              (filter_eps, block_skip_eps) on hidden states of real text
              from SmolLM2-135M (float32, dense tied head).

CPU sizes: the target H (576 / 2048 / 2560) and N = 8192 take tens of
minutes per run on a 2-core CPU, and the stock loss at N = 8192 needs 19 GB
(float32) or ~10 GB (bf16) there, so on the CPU the defaults shrink H to 256
and N to 2048 / 1024 for the two large vocabularies (``--cpu-full`` keeps
the target sizes). On a GPU the target sizes are used. Every row says
which N and H it ran.

    env LD_PRELOAD=.../libopenblas.so.0 \\
        python benchmarks/bench_flash_cce.py --heads --step --crossover --filters
"""

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time

import common
import mlx.core as mx
import mlx.nn as nn

ISSUE_SHAPES = [(2048, 49152, 576), (8192, 151936, 2048), (8192, 262144, 2560)]
CPU_SHAPES = [(2048, 49152, 576), (2048, 151936, 256), (1024, 262144, 256)]


def on_gpu():
    return mx.default_device() == mx.gpu


def _sync():
    mx.synchronize()


COMPILED = []  # --compiled: time what mlx_lm.lora runs, the gradient under mx.compile


def measure(fn, args, repeats, warmup):
    """(min seconds, peak bytes above the inputs, loss) of ``value_and_grad(fn)(*args)``."""
    t, peak, value = common.grad_cost(fn, args, repeats, warmup, compiled=bool(COMPILED))
    return t.min, peak, value


def head_case(n, v, h, dtype, quantized, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hidden = mx.random.normal((n, h), key=k1).astype(dtype)
    weight = (mx.random.normal((v, h), key=k2) / h**0.5).astype(dtype)
    targets = mx.random.randint(0, v, (n,), key=k3)
    if quantized:
        layer = nn.QuantizedLinear(h, v, bias=False, group_size=64, bits=4)
        layer.weight, layer.scales, layer.biases = mx.quantize(weight, group_size=64, bits=4)
        head = layer
    else:
        head = weight
    mx.eval(hidden, head.parameters() if quantized else head, targets)
    return hidden, head, targets


def _head_row(a, rows, n, v, h, dtype):
    from mlx_lm_flash_cce import linear_cross_entropy

    hidden, head, targets = head_case(n, v, h, dtype, a.quantized)
    call = head if not a.quantized else head

    def stock(x):
        logits = call(x) if a.quantized else x @ head.T
        return nn.losses.cross_entropy(logits, targets).astype(mx.float32).mean()

    opts = json.loads(a.flash_opts) if a.flash_opts else {}

    def flash(x):
        return linear_cross_entropy(x, head, targets, impl="flash", **opts)

    result = {
        "N": n,
        "V": v,
        "H": h,
        "dtype": a.dtype,
        "head": "q4" if a.quantized else "dense",
        "device": str(mx.default_device()),
        "opts": opts,
    }
    stock_bytes = 4 * n * v * dtype.size
    if stock_bytes > a.max_stock_bytes:
        result["stock"] = None
        print(f"  skip stock at N={n} V={v}: needs ~{stock_bytes / 2**30:.1f} GiB", flush=True)
    else:
        result["stock"] = measure(stock, [hidden], a.repeats, a.warmup)
    old_limit = None
    if a.memory_limit_mib:
        # MLX waits for queued work once active memory passes the limit:
        # on a GPU this is what keeps asynchronous evaluation bounded.
        old_limit = mx.set_memory_limit(mx.get_active_memory() + int(a.memory_limit_mib * 2**20))
        result["memory_limit_mib"] = a.memory_limit_mib
    try:
        result["flash"] = measure(flash, [hidden], a.repeats, a.warmup)
    finally:
        if old_limit is not None:
            mx.set_memory_limit(old_limit)
    rows.append(result)
    print_heads([result], header=len(rows) == 1)


def run_heads(a, rows):

    shapes = ISSUE_SHAPES if (on_gpu() or a.cpu_full) else CPU_SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    dtype = getattr(mx, a.dtype)
    for n, v, h in shapes:
        _head_row(a, rows, n, v, h, dtype)
        gc.collect()
        mx.clear_cache()


def _mib(b):
    return f"{b / 2**20:9.1f}"


def print_heads(rows, header=True):
    if header:
        print(
            f"{'N':>6} {'V':>7} {'H':>5} {'dtype':>8} {'head':>5} | {'stock s':>8} {'flash s':>8} {'time x':>6} | "
            f"{'stock MiB':>9} {'flash MiB':>9} {'mem ÷':>7} | loss stock / flash"
        )
    for r in rows:
        f_t, f_m, f_l = r["flash"]
        if r["stock"] is None:
            s = f"{'-':>8} {f_t:8.3f} {'-':>6} | {'-':>9} {_mib(f_m)} {'-':>7} | - / {f_l:.5f}"
        else:
            s_t, s_m, s_l = r["stock"]
            s = (
                f"{s_t:8.3f} {f_t:8.3f} {f_t / s_t:6.2f} | {_mib(s_m)} {_mib(f_m)} {s_m / max(f_m, 1):7.1f} | "
                f"{s_l:.5f} / {f_l:.5f}"
            )
        print(
            f"{r['N']:>6} {r['V']:>7} {r['H']:>5} {r['dtype']:>8} {r['head']:>5} | {s}", flush=True
        )


# ------------------------------------------------------------- gpu table

GPU_SHAPES = [(8192, 151936, 2048), (8192, 262144, 2560), (8192, 151936, 4096)]
# cuda-gemm rows: blocks, optional memory limit (MLX's backpressure on CUDA, see cuda_gemm.py)
GEMM_CONFIGS = (
    "8192x8192",
    "8192x8192@512",
    "4096x8192@256",
    "2048x8192@128",
    "8192x16384@1024",
    "mlx:8192x8192@512",
)


def _time_only(fn, args, repeats):
    """Min seconds of ``fn(*args)`` evaluated (no gradient): the fused forward alone."""
    mx.eval(fn(*args))
    _sync()
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn(*args))
        _sync()
        best = min(best, time.perf_counter() - tic)
    return best


def gemm_method(config, head, targets, frozen):
    """A ``cuda-gemm`` row from ``[mlx:]TCxVC[@LIMIT_MIB]`` (mlx: the MLX elementwise step, not the kernel)."""
    from mlx_lm_flash_cce import linear_cross_entropy

    elementwise = None
    if config.startswith("mlx:"):
        elementwise, config = "mlx", config[4:]
    blocks, _, limit = config.partition("@")
    tc, vc = (int(x) for x in blocks.split("x"))
    name = f"cuda-gemm{' mlx-ew' if elementwise else ''} {tc}x{vc}"

    def fn(x):
        return linear_cross_entropy(
            x,
            head,
            targets,
            impl="flash",
            backend="cuda-gemm",
            train=frozen,
            token_chunk=tc,
            vocab_chunk=vc,
            elementwise=elementwise,
        )

    return name, fn, int(limit) if limit else None


def _gpu_rows(a, rows, quantized, n, v, h, frozen):
    from mlx_lm_flash_cce import cuda, linear_cross_entropy

    hidden, head, targets = head_case(n, v, h, mx.bfloat16, quantized)
    kind = "q4" if quantized else "bf16"
    if cuda.plan(head, hidden) != "cuda":
        print(f"  kernels not used: {cuda.plan(head, hidden)}")

    def stock(x):
        logits = head(x) if quantized else x @ head.T
        return nn.losses.cross_entropy(logits, targets).astype(mx.float32).mean()

    def stock_dequantized(x):  # where MLX's quantized_matmul fails at this shape
        w = mx.dequantize(head.weight, head.scales, head.biases, group_size=64, bits=4)
        return nn.losses.cross_entropy(x @ w.T, targets).astype(mx.float32).mean()

    methods = [
        ("stock", stock, None),
        (
            "fused cuda",
            lambda x: linear_cross_entropy(
                x, head, targets, impl="flash", backend="cuda", train=frozen
            ),
            None,
        ),
        (
            "pure-mlx",
            lambda x: linear_cross_entropy(
                x, head, targets, impl="flash", backend="mlx-blocks", train=frozen
            ),
            None,
        ),
        (
            "pure-mlx big",
            lambda x: linear_cross_entropy(
                x,
                head,
                targets,
                impl="flash",
                backend="mlx-blocks",
                train=frozen,
                token_chunk=8192,
                chunk_elements=1 << 26,
            ),
            256,
        ),
    ] + [gemm_method(c, head, targets, frozen) for c in a.gemm_configs]
    base = None
    for name, fn, limit in methods:
        if name.startswith("pure-mlx") and a.skip_mlx or name == "fused cuda" and a.skip_fused:
            continue
        old = None
        if limit:
            old = mx.set_memory_limit(mx.get_active_memory() + limit * 2**20)
        try:
            t, m, value = measure(fn, [hidden], a.repeats, a.warmup)
        except Exception as e:  # noqa: BLE001 (a kernel that fails to build is one failed row)
            print(
                f"{n:>5} {v:>7} {h:>5} {kind:>5} {name:>14} | failed: {str(e)[:300]}",
                flush=True,
            )
            rows.append({"N": n, "V": v, "H": h, "head": kind, "method": name, "error": str(e)})
            if name != "stock" or not quantized:
                continue
            name, fn = "stock (deq.)", stock_dequantized
            t, m, value = measure(fn, [hidden], a.repeats, a.warmup)
        finally:
            if old is not None:
                mx.set_memory_limit(old)
        if base is None:
            base = (t, m)
        label = name + (f" (limit +{limit})" if limit else "")
        rows.append(
            {
                "N": n,
                "V": v,
                "H": h,
                "head": kind,
                "method": label,
                "seconds": t,
                "peak": m,
                "loss": value,
            }
        )
        print(
            f"{n:>5} {v:>7} {h:>5} {kind:>5} {label:>14} | {t * 1e3:7.1f} {t / base[0]:7.2f} | "
            f"{_mib(m)} {base[1] / max(m, 1):10.1f} | {value:.5f}",
            flush=True,
        )
    if a.skip_fused:
        return
    try:
        fwd = _time_only(
            lambda x: linear_cross_entropy(
                x, head, targets, impl="flash", backend="cuda", train=frozen
            ),
            [hidden],
            a.repeats,
        )
    except Exception as e:  # noqa: BLE001 (no CUDA GPU: the fused rows failed above too)
        print(
            f"{n:>5} {v:>7} {h:>5} {kind:>5} {'fused fwd only':>14} | failed: {str(e)[:120]}",
            flush=True,
        )
        return
    rows.append(
        {
            "N": n,
            "V": v,
            "H": h,
            "head": kind,
            "method": "fused forward only",
            "seconds": fwd,
        }
    )
    print(
        f"{n:>5} {v:>7} {h:>5} {kind:>5} {'fused fwd only':>14} | {fwd * 1e3:7.1f} {fwd / base[0]:7.2f} |",
        flush=True,
    )


def run_gpu_table(a, rows):

    shapes = GPU_SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    frozen = {"weight": False}  # LoRA training: the head gets no gradient
    print(
        f"\ngpu table: loss + hidden-state gradient, frozen head, min of {a.repeats} after {a.warmup} warm-up; "
        "MiB = peak above the inputs"
    )
    print(
        f"{'N':>5} {'V':>7} {'H':>5} {'head':>5} {'method':>14} | {'ms':>7} {'x stock':>7} | {'MiB':>9} "
        f"{'stock/this':>10} | loss"
    )
    for quantized in [k == "q4" for k in a.kinds]:
        for n, v, h in shapes:
            _gpu_rows(a, rows, quantized, n, v, h, frozen)
            gc.collect()
            mx.clear_cache()


# ------------------------------------------------------------ auto table

# (label, backend, tokens x vocab blocks, limit MiB, elementwise)
AUTO_PATHS = [
    ("mlx 8192x32768 +1024", "mlx-blocks", (8192, 32768), 1024, None),
    ("mlx 8192x16384 +1024", "mlx-blocks", (8192, 16384), 1024, None),
    ("mlx f32-step 8192x16384 +1024", "mlx-blocks", (8192, 16384), 1024, "mlx-f32"),
    ("mlx 8192x8192 +512", "mlx-blocks", (8192, 8192), 512, None),
    ("mlx 4096x8192 +256", "mlx-blocks", (4096, 8192), 256, None),
    ("mlx 2048x8192 +128", "mlx-blocks", (2048, 8192), 128, None),
    ("mlx 4096x16384 +128", "mlx-blocks", (4096, 16384), 128, None),
    ("cuda-gemm 8192x32768 +1024", "cuda-gemm", (8192, 32768), 1024, None),
    ("cuda-gemm 8192x16384 +1024", "cuda-gemm", (8192, 16384), 1024, None),
    ("cuda-gemm 2048x8192 +128", "cuda-gemm", (2048, 8192), 128, None),
    ("cuda fused", "cuda", None, 0, None),
]


def _auto_rows(a, rows, kind, quantized, n, v, h, dtype, frozen, here):
    from mlx_lm_flash_cce import autotune, linear_cross_entropy

    hidden, head, targets = head_case(n, v, h, dtype, quantized)

    def stock(x):
        logits = head(x) if quantized else x @ head.T
        return nn.losses.cross_entropy(logits, targets).astype(mx.float32).mean()

    def path(backend, blocks, ew):
        kw = {"token_chunk": blocks[0], "vocab_chunk": blocks[1]} if blocks else {}
        return lambda x: linear_cross_entropy(
            x,
            head,
            targets,
            impl="flash",
            backend=backend,
            train=frozen,
            elementwise=ew,
            **kw,
        )

    methods = [("stock", stock, 0)]
    for label, backend, blocks, limit, ew in AUTO_PATHS:
        if backend in here and (a.auto_paths is None or label in a.auto_paths):
            methods.append((label, path(backend, blocks, ew), limit))
    base = None

    def row(label, t, m, value, extra=None):
        r = {
            "N": n,
            "V": v,
            "H": h,
            "head": kind,
            "method": label,
            "seconds": t,
            "peak": m,
            "loss": value,
        }
        r.update(extra or {})
        rows.append(r)
        ratio = f"{t / base[0]:7.2f}" if base else f"{'-':>7}"
        mem = f"{base[1] / max(m, 1):10.1f}" if base else f"{'-':>10}"
        print(
            f"{n:>5} {v:>7} {h:>5} {kind:>5} {label:>30} | {t * 1e3:7.1f} {ratio} | {m / 2**20:7.0f} "
            f"{mem} | {value:.5f}",
            flush=True,
        )

    for label, fn, limit in methods:
        old = mx.set_memory_limit(mx.get_active_memory() + limit * 2**20) if limit else None
        try:
            t, m, value = measure(fn, [hidden], a.repeats, a.warmup)
        except Exception as e:  # noqa: BLE001 (a path that fails here is one failed row)
            print(
                f"{n:>5} {v:>7} {h:>5} {kind:>5} {label:>30} | failed: {str(e)[:200]}",
                flush=True,
            )
            rows.append({"N": n, "V": v, "H": h, "head": kind, "method": label, "error": str(e)})
            continue
        finally:
            if old is not None:
                mx.set_memory_limit(old)
        if label == "stock":
            base = (t, m)
        row(label, t, m, value)
    for budget in a.auto_budgets:
        nbytes = None if budget == "default" else budget
        autotune._MEMORY.clear()
        os.environ[autotune.CACHE_ENV] = a.auto_cache  # a fresh trial: nothing cached
        path_ = autotune.cache_path()
        if path_.exists():
            path_.unlink()
        lines = []
        handler = _Collect(lines)
        logging.getLogger("mlx_lm_flash_cce").addHandler(handler)
        logging.getLogger("mlx_lm_flash_cce").setLevel(logging.INFO)
        fn = lambda x, nbytes=nbytes: linear_cross_entropy(
            x, head, targets, train=frozen, memory_budget=nbytes
        )
        from mlx_lm_flash_cce import budget as _b

        tic = time.perf_counter()
        try:
            mx.eval(fn(hidden))  # the first call runs the trial
            _sync()
            first = time.perf_counter() - tic
            cand = autotune._MEMORY[next(iter(autotune._MEMORY))].candidate
            # measured under the limit the call holds, as in training
            # (an explicit budget: inputs + the path's limit; the
            # default: no lower than budget.device_floor())
            _b.LIMIT.release()
            t, m, value = measure(fn, [hidden], a.repeats, a.warmup)
        except Exception as e:  # noqa: BLE001 (e.g. a budget no path fits)
            print(
                f"{n:>5} {v:>7} {h:>5} {kind:>5} {'auto @' + str(budget):>30} | {str(e)[:300]}",
                flush=True,
            )
            rows.append(
                {
                    "N": n,
                    "V": v,
                    "H": h,
                    "head": kind,
                    "method": f"auto @{budget}",
                    "error": str(e),
                }
            )
            continue
        finally:
            _b.LIMIT.release()
            logging.getLogger("mlx_lm_flash_cce").removeHandler(handler)
        row(f"auto @{budget}: {cand.label}", t, m, value, {"trial_s": first, "log": lines})
        print(
            f"{'':>26} trial (first call) {first:.2f} s; {lines[-1] if lines else ''}",
            flush=True,
        )


def run_auto_table(a, rows):
    from mlx_lm_flash_cce import backends

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes] if a.shapes else GPU_SHAPES[:2]
    frozen = {"weight": False}
    dtype = getattr(mx, a.dtype)
    here = backends.available()
    print(
        f"\nauto table: loss + hidden-state gradient, frozen head, {a.dtype}, min of {a.repeats} after "
        f"{a.warmup} warm-up; MiB = peak above the inputs; x = against stock in this run"
    )
    print(
        f"{'N':>5} {'V':>7} {'H':>5} {'head':>5} {'path':>30} | {'ms':>7} {'x stock':>7} | {'MiB':>7} "
        f"{'stock/this':>10} | loss"
    )
    for kind in a.kinds:
        quantized = kind == "q4"
        for n, v, h in shapes:
            _auto_rows(a, rows, kind, quantized, n, v, h, dtype, frozen, here)
            gc.collect()
            mx.clear_cache()


class _Collect(logging.Handler):
    def __init__(self, lines):
        super().__init__()
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


# ------------------------------------------------------------- crossover


def run_crossover(a, rows):
    from mlx_lm_flash_cce import linear_cross_entropy

    v, h = 49152, 576
    dtype = getattr(mx, a.dtype)
    print(f"\ncrossover: V={v} H={h} {a.dtype}; loss+grad seconds (min of {a.repeats})")
    print(f"{'N':>6} {'N*V':>10} | {'stock s':>8} {'flash s':>8} {'time x':>6}")
    for n in a.crossover_n:
        hidden, head, targets = head_case(n, v, h, dtype, False)
        stock = lambda x, head=head, targets=targets: (
            nn.losses.cross_entropy(x @ head.T, targets).astype(mx.float32).mean()
        )
        flash = lambda x, head=head, targets=targets: linear_cross_entropy(
            x, head, targets, impl="flash"
        )
        s = measure(stock, [hidden], a.repeats, 1)
        f = measure(flash, [hidden], a.repeats, 1)
        rows.append({"N": n, "V": v, "H": h, "stock": s, "flash": f})
        print(f"{n:>6} {n * v:>10} | {s[0]:8.4f} {f[0]:8.4f} {f[0] / s[0]:6.2f}", flush=True)


# ---------------------------------------------------------------- filters


def real_hidden(model_name, n_tokens):
    """Final hidden states of SmolLM2 on real text, its head, and the targets."""
    import sysconfig
    from pathlib import Path

    from mlx_lm import load

    from mlx_lm_ext import models

    model, tok = load(str(models.build(model_name, progress=False)))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = tok.encode(text)[: n_tokens + 1]
    x = mx.array(ids)[None]
    hidden = model.model(x[:, :-1])[0]
    mx.eval(hidden)
    return model, hidden, x[0, 1:]


def run_filters(a, rows):
    from mlx_lm_flash_cce import linear_cross_entropy

    model, hidden, targets = real_hidden("smollm2-135m-f32", a.filter_tokens)
    head = model.model.embed_tokens.as_linear
    print(
        f"\nfilters: SmolLM2-135M float32, {targets.size} tokens of real text (CPython LICENSE), V=49152"
    )
    print(
        f"{'option':>22} | {'seconds':>8} {'time x':>6} | {'max |dh err| / max |dh|':>24} {'rel. L2 err':>11}"
    )
    exact = measure(
        lambda x: linear_cross_entropy(x, head, targets, impl="flash"), [hidden], a.repeats, 1
    )
    g_exact = mx.grad(lambda x: linear_cross_entropy(x, head, targets, impl="flash"))(hidden)
    mx.eval(g_exact)
    print(f"{'exact':>22} | {exact[0]:8.3f} {1.0:6.2f} | {0.0:24.2e} {0.0:11.2e}", flush=True)
    for key in ("filter_eps", "block_skip_eps"):
        for eps in a.filter_eps:
            fn = lambda x, key=key, eps=eps: linear_cross_entropy(
                x, head, targets, impl="flash", **{key: eps}
            )
            m = measure(fn, [hidden], a.repeats, 1)
            g = mx.grad(fn)(hidden)
            err = (mx.abs(g - g_exact).max() / mx.abs(g_exact).max()).item()
            l2 = (mx.sqrt(((g - g_exact) ** 2).sum()) / mx.sqrt((g_exact**2).sum())).item()
            rows.append(
                {
                    "option": key,
                    "eps": eps,
                    "seconds": m[0],
                    "exact_seconds": exact[0],
                    "max_err": err,
                    "l2_err": l2,
                }
            )
            print(
                f"{key + '=' + format(eps, 'g'):>22} | {m[0]:8.3f} {m[0] / exact[0]:6.2f} | {err:24.2e} {l2:11.2e}",
                flush=True,
            )


# -------------------------------------------------------------- lora step


def one_step(loss_name, model_name, batch, seq, layers, steps):
    """Run in a fresh process: time and peak memory of the trainer's compiled step."""
    from functools import partial

    import mlx.optimizers as optim
    from mlx_lm import load
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlx_lm_ext import models
    from mlx_lm_flash_cce import make_loss

    if model_name == "random-llama-1b":
        model = random_llama()
        data = mx.random.randint(0, model.args.vocab_size, (batch, seq + 1), key=mx.random.key(0))
    else:
        model, tok = load(str(models.build(model_name, progress=False)))
        import sysconfig
        from pathlib import Path

        text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
        ids = tok.encode(text)
        data = mx.array([ids[i * seq : (i + 1) * seq + 1] for i in range(batch)])
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, layers, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    lines = []
    logging.getLogger("mlx_lm_flash_cce").addHandler(_Collect(lines))
    logging.getLogger("mlx_lm_flash_cce").setLevel(logging.INFO)
    if loss_name.endswith("-nolimit"):  # measurement only: the path without MLX's backpressure
        from mlx_lm_flash_cce import budget as _b

        _b.LIMIT.hold = lambda extra: 0
    options = {}
    if "@" in loss_name:  # flash-cce@2G: an explicit --cce-memory-budget
        options["memory_budget"] = loss_name.split("@")[1]
    loss = default_loss if loss_name == "default" else make_loss(model, verbose=False, **options)
    lengths = mx.array([[0, seq]] * batch)
    opt = optim.Adam(learning_rate=1e-5)
    lvg = nn.value_and_grad(model, loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(data, lengths):
        (lvalue, toks), grad = lvg(model, data, lengths)
        opt.update(model, grad)
        return lvalue, toks

    model.train()
    out = []
    for _ in range(steps + 1):  # the first step compiles
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        lvalue, toks = step(data, lengths)
        mx.eval(state, lvalue, toks)
        _sync()
        out.append(
            (
                time.perf_counter() - tic,
                mx.get_peak_memory() - base,
                mx.get_peak_memory(),
                lvalue.item(),
            )
        )
    return {"loss": loss_name, "first": out[0], "steps": out[1:], "log": lines}


def random_llama():
    """A ~1.3B-parameter llama (16 layers, hidden 2048, V=151936, tied) with random bf16 weights."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def run_step(a, rows):
    print(
        f"\nlora step: {a.step_model}, batch {a.step_batch} x {a.step_seq} tokens, LoRA on {a.step_layers} layers, "
        f"compiled trainer step, fresh process per loss (min of {a.step_repeats} after a compiling step)"
    )
    print(
        f"{'loss':>10} | {'step s':>8} | {'peak MiB above weights':>22} {'process peak MiB':>16} | loss"
    )
    results = {}
    for loss_name in a.step_losses:
        cmd = [
            sys.executable,
            __file__,
            "--_one-step",
            loss_name,
            "--step-model",
            a.step_model,
            "--step-batch",
            str(a.step_batch),
            "--step-seq",
            str(a.step_seq),
            "--step-layers",
            str(a.step_layers),
            "--step-repeats",
            str(a.step_repeats),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:])
            raise SystemExit(f"step with {loss_name} failed")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[loss_name] = r
        best = min(r["steps"], key=lambda s: s[0])
        peak = max(s[1] for s in r["steps"])
        total = max(s[2] for s in r["steps"])
        print(
            f"{loss_name:>10} | {best[0]:8.3f} | {_mib(peak):>22} {_mib(total):>16} | {best[3]:.5f} | first step "
            f"{r['first'][0]:.2f} s",
            flush=True,
        )
        for line in r.get("log", []):
            print(f"{'':>12} {line}", flush=True)
    d = results["default"]
    for name, f in results.items():
        if name == "default":
            continue
        dt = min(s[0] for s in f["steps"]) / min(s[0] for s in d["steps"])
        dm = max(s[1] for s in d["steps"]) / max(max(s[1] for s in f["steps"]), 1)
        print(
            f"{'ratio':>10} | {name}: {dt:.3f}x time | {dm:.2f}x less peak memory above the weights"
        )
    rows.append(results)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--heads", action="store_true")
    p.add_argument("--step", action="store_true")
    p.add_argument("--crossover", action="store_true")
    p.add_argument("--filters", action="store_true")
    p.add_argument(
        "--gpu-table", action="store_true", help="CUDA: fused kernels vs stock vs pure-MLX"
    )
    p.add_argument("--skip-mlx", action="store_true", help="--gpu-table without the pure-MLX rows")
    p.add_argument(
        "--skip-fused", action="store_true", help="--gpu-table without the fused-kernel rows"
    )
    p.add_argument(
        "--gemm-configs",
        nargs="*",
        default=list(GEMM_CONFIGS),
        help="--gpu-table cuda-gemm rows: [mlx:]TOKENSxVOCAB[@LIMIT_MIB] each "
        "(mlx: MLX elementwise step; @: mx.set_memory_limit(inputs + LIMIT MiB)); none: no rows",
    )
    p.add_argument(
        "--kinds",
        nargs="*",
        default=["bf16", "q4"],
        choices=["bf16", "q4"],
        help="--gpu-table heads (default both)",
    )
    p.add_argument("--shapes", nargs="*", help="NxVxH triples, e.g. 2048x49152x576")
    p.add_argument("--cpu-full", action="store_true", help="the target N and H on the CPU too")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument(
        "--quantized", action="store_true", help="4-bit head (group 64) instead of a dense one"
    )
    p.add_argument("--flash-opts", default=None, help="JSON options for linear_cross_entropy")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed runs first (default: 1 on GPU, 0 on CPU)"
    )
    p.add_argument(
        "--max-stock-bytes",
        type=float,
        default=6e9,
        help="skip the stock loss where its logits x4 exceed this (default 6e9)",
    )
    p.add_argument(
        "--memory-limit-mib",
        type=float,
        default=None,
        help="during flash runs, mx.set_memory_limit(inputs + this many MiB)",
    )
    p.add_argument("--crossover-n", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--filter-tokens", type=int, default=512)
    p.add_argument("--filter-eps", type=float, nargs="*", default=[1e-6, 1e-5, 1e-4])
    p.add_argument("--step-model", default="smollm2-135m")
    p.add_argument("--step-batch", type=int, default=4)
    p.add_argument("--step-seq", type=int, default=512)
    p.add_argument("--step-layers", type=int, default=4)
    p.add_argument("--step-repeats", type=int, default=1)
    p.add_argument(
        "--step-losses",
        nargs="*",
        default=["default", "flash-cce"],
        help="default, flash-cce, flash-cce@SIZE (an explicit memory budget), "
        "flash-cce-nolimit (without MLX's backpressure)",
    )
    p.add_argument("--auto-table", action="store_true")
    p.add_argument(
        "--auto-paths", nargs="*", default=None, help="--auto-table: only these path labels"
    )
    p.add_argument(
        "--auto-budgets", nargs="*", default=["default"], help="--auto-table: budgets for auto rows"
    )
    p.add_argument(
        "--auto-cache",
        default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "flash-cce-bench-cache"),
        help="--auto-table: a scratch folder for auto's cache (emptied per row)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="time loss + gradient under mx.compile, as mlx_lm.lora's training step runs it",
    )
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--_one-step", dest="one_step", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one_step:
        r = one_step(
            a.one_step, a.step_model, a.step_batch, a.step_seq, a.step_layers, a.step_repeats
        )
        print(json.dumps(r))
        return
    a.dtype = a.dtype or ("bfloat16" if on_gpu() else "float32")
    a.warmup = a.warmup if a.warmup is not None else (1 if on_gpu() else 0)
    if a.compiled:
        COMPILED.append(True)
    if not (a.heads or a.step or a.crossover or a.filters or a.gpu_table or a.auto_table):
        a.heads = True
    info = common.print_header()
    blas = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "bundled BLAS"
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}"
        + (f" ({blas})" if not on_gpu() else "")
        + f", dtype {a.dtype}, min of {a.repeats} runs"
    )
    results = {}
    if a.heads:
        results["heads"] = []
        run_heads(a, results["heads"])
    if a.gpu_table:
        results["gpu_table"] = []
        run_gpu_table(a, results["gpu_table"])
    if a.auto_table:
        results["auto_table"] = []
        run_auto_table(a, results["auto_table"])
    if a.crossover:
        results["crossover"] = []
        run_crossover(a, results["crossover"])
    if a.filters:
        results["filters"] = []
        run_filters(a, results["filters"])
    if a.step:
        results["step"] = []
        run_step(a, results["step"])
    if a.json:
        common.dump_json(a.json, results, info)


if __name__ == "__main__":
    main()
