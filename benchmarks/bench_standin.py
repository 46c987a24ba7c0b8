"""What the memory-bound stand-in costs against SmolLM2-135M, same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_standin.py --size 1B

The stand-in (``mlx_lm_ext.standin``, built here in memory) is SmolLM2-135M
with its MLPs widened by zero-output rows: it predicts what SmolLM2 does and
costs what a model of ``--size`` parameters costs per forward. Prints:

- ms per forward over 1, 2, 4, 8, 16 tokens after a cached prefix (a verify
  forward's shape), base and stand-in, and each against its own 1-token
  forward: near 1.0 across widths is the memory-bound regime where drafting
  pays;
- tokens/s of mlx-lm's greedy decoding (``stream_generate``, generation only)
  and whether the two texts are the same.
"""

import argparse
import statistics
import subprocess
import sys
import time

import common
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_lm_ext import models, standin

PROMPT = "Explain in a few sentences why the sky is blue."


def forward_ms(model, widths, prefix=64, reps=5, clock=time.perf_counter):
    """Median ms of one forward over ``w`` tokens after a ``prefix``-token cache.

    ``clock=time.process_time`` counts this process's CPU time (all threads):
    steadier than wall time on a machine that other jobs share.
    """
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(prefix)[None] % 1000 + 100, cache=cache))
    out = {}
    for w in widths:
        tokens = mx.arange(200, 200 + w)[None]
        mx.eval(model(tokens, cache=cache))  # warm-up
        trim_prompt_cache(cache, w)
        times = []
        for _ in range(reps):
            t0 = clock()
            mx.eval(model(tokens, cache=cache))
            times.append(clock() - t0)
            trim_prompt_cache(cache, w)
        out[w] = 1e3 * statistics.median(times)
    return out


def decode(model, tokenizer, max_tokens):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        text += last.text
    return text, last.generation_tps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1B", help="the stand-in's parameter count (default 1B)")
    p.add_argument("--layers", type=int, default=0, help="zero-output layers to add (default 0)")
    p.add_argument("--dtype", choices=tuple(standin.DTYPES), default="float32")
    p.add_argument("--widths", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=5, help="forwards per width (median)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="forward times in wall or in this process's CPU time (default wall)",
    )
    p.add_argument("--device", choices=("cpu", "gpu"), default=None, help="default: MLX's")
    args = p.parse_args()
    try:
        widths = [int(w) for w in args.widths.split(",")]
        assert widths and min(widths) >= 1
    except (ValueError, AssertionError):
        p.error(f"--widths: comma-separated positive integers, got {args.widths!r}")
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    common.print_header()

    from mlx_lm import load

    try:
        wide, tokenizer = standin.load(args.size, layers=args.layers, dtype=args.dtype)
    except models.ModelError as e:
        p.error(str(e))
    base, _ = load(str(models.build("smollm2-135m-f32", progress=False)))
    if args.dtype != "float32":
        base.set_dtype(getattr(mx, args.dtype))
    n_base = sum(v.size for _, v in tree_flatten(base.parameters()))
    n_wide = sum(v.size for _, v in tree_flatten(wide.parameters()))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {args.dtype} on {mx.default_device()}, commit {commit or '?'}: SmolLM2-135M "
        f"({n_base / 1e6:.0f}M parameters) against its stand-in --size {args.size} "
        f"({n_wide / 1e9:.2f}B: MLP width {wide.args.intermediate_size}, "
        f"{len(wide.layers)} layers)\n",
        flush=True,
    )
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    costs = {"base": forward_ms(base, widths, reps=args.reps, clock=clock)}
    costs["stand-in"] = forward_ms(wide, widths, reps=args.reps, clock=clock)
    print(
        f"forward over N tokens after a 64-token prefix, median of {args.reps}, {args.clock} ms\n"
    )
    print("| tokens | base ms | stand-in ms | stand-in / base | base / own 1 | stand-in / own 1 |")
    print("|---|---|---|---|---|---|")
    b, s = costs["base"], costs["stand-in"]
    for w in widths:
        print(
            f"| {w} | {b[w]:.1f} | {s[w]:.1f} | {s[w] / b[w]:.2f} | {b[w] / b[widths[0]]:.2f} "
            f"| {s[w] / s[widths[0]]:.2f} |"
        )
    text_base, tps_base = decode(base, tokenizer, args.max_tokens)
    text_wide, tps_wide = decode(wide, tokenizer, args.max_tokens)
    print(f"\n| model | tok/s (mlx-lm greedy, {args.max_tokens} tokens) | same text |")
    print("|---|---|---|")
    print(f"| base | {tps_base:.1f} | |")
    print(f"| stand-in | {tps_wide:.1f} | {'yes' if text_base == text_wide else 'NO'} |")
    print(f"\nstand-in decodes at {tps_wide / tps_base:.2f}x the base's tokens/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
