"""How much of a synchronous forward is the host building it, and what
handing it to the device in stages (``host.flush_layers``) saves.

    python benchmarks/profile_flush.py --device gpu --dtype bfloat16 --standin 10B

A verify forward is read back at once: unlike mlx-lm's pipelined plain
steps, whose next graph the host builds while the device runs the current
one, nothing overlaps its graph building. Per batch size B and window width
W, on a prefilled cache, the median over 10 (after 2 warm-ups) of:

- ``build``: building the forward's graph (Python; with flushing, also
  encoding the flushed layers' kernels, which ``mx.async_eval`` does on the
  calling thread);
- ``sync``: built, evaluated and its argmax read back;

for ``--every`` 0 (no flushing) and each k: every k-th layer's output
handed to ``mx.async_eval`` as soon as it is built. Above each table: a
pipelined plain step at that B (what stock decoding costs per token).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_device_args,
    add_target_args,
    load_target,
    print_header,
    set_device,
    target_name,
)

from mlx_lm_ext import host  # noqa: E402

PROMPT = list(range(100, 400))


def pipelined_step(model, cache, B, n=30):
    """Median seconds per token of mlx-lm-style pipelined ``[B, 1]`` steps."""
    y = mx.array([[PROMPT[-1]]] * B, mx.uint32)
    nxt = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)
    mx.async_eval(nxt)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        cur = nxt
        nxt = mx.argmax(model(cur[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(nxt)
        cur.tolist()
        times.append(time.perf_counter() - t)
    mx.eval(nxt)
    trim_prompt_cache(cache, n + 1)
    return statistics.median(times[5:])


def sync_forward(model, cache, B, W, every, repeats=10):
    """Median (build, total) seconds of a ``[B, W]`` forward read back."""
    x = mx.array([[PROMPT[-1]] * W] * B, mx.uint32)
    builds, totals = [], []
    with host.flush_layers(model, every):
        for _ in range(repeats + 2):
            t = time.perf_counter()
            out = mx.argmax(model(x, cache=cache), axis=-1)
            built = time.perf_counter()
            out.tolist()
            builds.append(built - t)
            totals.append(time.perf_counter() - t)
            trim_prompt_cache(cache, W)
    return statistics.median(builds[2:]), statistics.median(totals[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap, "cpu")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--every", default="0,2,5,10", help="layers per flush (0: none)")
    add_target_args(ap)
    args = ap.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    set_device(args)
    print_header()
    model, _ = load_target(args, args.dtype)
    print(f"# {target_name(args, args.dtype)} on {args.device}: build / sync ms, median of 10")
    everies = ints(args.every)
    for B in ints(args.batches):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([PROMPT] * B, mx.uint32), cache=cache))
        print(f"\n## B={B}: pipelined plain step {1e3 * pipelined_step(model, cache, B):.2f} ms")
        print("| W | " + " | ".join(f"every={k}" for k in everies) + " |")
        print("|---|" + "---|" * len(everies))
        for W in ints(args.widths):
            cells = [sync_forward(model, cache, B, W, k) for k in everies]
            print(
                f"| {W} | " + " | ".join(f"{1e3 * b:.2f} / {1e3 * t:.2f}" for b, t in cells) + " |"
            )


if __name__ == "__main__":
    main()
