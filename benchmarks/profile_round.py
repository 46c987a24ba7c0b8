"""Where a speculative round's time goes, next to a plain decoding step.

    python benchmarks/profile_round.py --drafter-path DIR [--dtype bfloat16]

On a fast GPU a 135M target's decoding step is bound by the host (building
the graph in Python, encoding and launching hundreds of small kernels), not
by the device, and mlx-lm hides part of that by building step t+1 while the
device runs step t. A verify round cannot be built before the previous one
is read back. This script measures, on one chat prompt's prefilled cache:

- ``plain, pipelined``: mlx-lm's ``generate_step`` (what stock decoding costs);
- ``plain, synced``: one step built, evaluated and read back at a time;
- ``verify w``: one forward over w tokens + argmax, read back (w = 1 is a
  synced plain step through the backbone/head split the loop uses);
- ``draft k``: the assistant's k chained steps, built lazily then evaluated;
- ``round k``: k drafts and the verify over them in one graph, read back
  (a drafting round without the loop's bookkeeping);

- ``verify 4, cache growing``: windows at a new cache length each time, as
  in decoding (MLX's cuDNN attention builds a graph per shape);

each as build time (graph construction in Python) and total, median of
``--repeats``, once per verify-attention policy (``--attention``); then the
real loop's tokens/s with drafting forced on (no auto-off) at fixed k,
adaptive, and with auto-off, against stock, on the same prompts.
"""

import argparse
import os
import statistics
import time

import mlx.core as mx
from common import add_target_args, load_assistant, load_target, print_header
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import mlx_lm_spec_decode as sd
from mlx_lm_spec_decode import assistant
from mlx_lm_spec_decode import target as target_mod
from mlx_lm_spec_decode.drafter import DraftContext

PROMPTS = {
    "advice": "I am starting to learn to cook. What should I learn first, and why?",
    "letter": "Write a friendly letter to a neighbour inviting them to a garden party.",
}


def timed(fn, repeats):
    """(median build seconds, median total seconds) of ``fn() -> (build_s, arrays)``."""
    builds, totals = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        build, arrays = fn()
        mx.eval(arrays)
        totals.append(time.perf_counter() - t0)
        builds.append(build)
    return statistics.median(builds[1:]), statistics.median(totals[1:])


def components(model, drafter, prompt, repeats):
    backbone, head = target_mod.split(model)
    cache = make_prompt_cache(model)
    h = backbone(mx.array(prompt[:-1], mx.uint32)[None], cache)
    mx.eval(h, [c.state for c in cache])
    ctx = DraftContext(model, cache, drafter.make_cache(), temp=0.0, filter=None)
    ctx.hidden = h[0, -1:]
    drafter.prefill(ctx, prompt)
    y = prompt[-1]
    rows = []

    def verify(w, grow=False):
        # grow: the cache keeps each window, as in decoding (every window
        # meets a new length: MLX's cuDNN attention builds a graph per shape).
        def fn():
            t0 = time.perf_counter()
            x = mx.array([y] * w, mx.uint32)[None]
            with target_mod.verify_attention(model, w):
                t = mx.argmax(head(backbone(x, cache))[0], axis=-1)
            build = time.perf_counter() - t0
            mx.eval(t)
            t.tolist()
            if not grow:
                trim_prompt_cache(cache, w)
            return build, t

        return fn

    def draft(k):
        def fn():
            t0 = time.perf_counter()
            d, _ = drafter.draft(ctx, k)
            return time.perf_counter() - t0, d

        return fn

    def round_(k):
        def fn():
            t0 = time.perf_counter()
            d, _ = drafter.draft(ctx, k)
            x = mx.concatenate([mx.array([y], mx.uint32), d])[None]
            with target_mod.verify_attention(model, k + 1):
                hid = backbone(x, cache)
            t = mx.argmax(head(hid)[0], axis=-1)
            build = time.perf_counter() - t0
            mx.eval(t, d)
            t.tolist(), d.tolist()
            trim_prompt_cache(cache, k + 1)
            return build, t

        return fn

    # Plain, pipelined: mlx-lm's own loop from the same prompt (its cache).
    def pipelined(n=64):
        c = make_prompt_cache(model)
        gen = generate_step(mx.array(prompt, mx.uint32), model, max_tokens=n + 8, prompt_cache=c)
        for _ in range(8):
            next(gen)
        t0 = time.perf_counter()
        for _ in range(n):
            next(gen)
        return (time.perf_counter() - t0) / n

    p = statistics.median(pipelined() for _ in range(3))
    rows.append(("plain, pipelined (mlx-lm generate_step)", None, p))
    b, t = timed(verify(1), repeats)
    rows.append(("plain, synced (verify 1)", b, t))
    for w in (2, 3, 4, 6, 8):
        b, t = timed(verify(w), repeats)
        rows.append((f"verify {w}", b, t))
    for k in (1, 2, 3, 4):
        b, t = timed(draft(k), repeats)
        rows.append((f"draft {k}", b, t))
    for k in (1, 2, 3, 4):
        b, t = timed(round_(k), repeats)
        rows.append((f"round {k} (draft {k} + verify {k + 1})", b, t))

    b, t = timed(verify(4, grow=True), repeats)
    trim_prompt_cache(cache, 4 * (repeats + 1))
    rows.append(("verify 4, cache growing", b, t))
    return rows


def tps(model, tok, prompt, max_tokens, draft=None, k=3):
    last = None
    for r in stream_generate(
        model, tok, prompt, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k
    ):
        last = r
    st = sd.last_stats() if draft is not None else None
    return last.generation_tps, st


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter-path", required=True)
    ap.add_argument("--model", default=None, help="Default: SmolLM2-135M float32 (built offline).")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--loop-repeats", type=int, default=3)
    ap.add_argument(
        "--ks", default="3,1,2", help="Fixed draft lengths for the forced-on loop rows."
    )
    ap.add_argument(
        "--attention",
        default="padded,explicit,fused",
        help="Verify attention policies to compare (MLX_LM_SPEC_ATTENTION), first is the main one.",
    )
    add_target_args(ap)
    args = ap.parse_args()
    print_header()

    import mlx_lm_ext
    from mlx_lm_ext import models

    mlx_lm_ext.enable("spec-decode")
    path = args.model or models.build("smollm2-135m-f32", progress=False)
    model, tok = load_target(args, args.dtype or "float32") if args.standin else load(str(path))
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    base = load_assistant(args, args.drafter_path, model)
    print(f"# {mx.default_device()}, dtype {args.dtype or 'as loaded'}, median of {args.repeats}\n")

    chat = {
        n: tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        for n, t in PROMPTS.items()
    }
    policies = args.attention.split(",")
    print(
        "| attention | what | build ms | total ms | x plain pipelined step |\n|---|---|---|---|---|"
    )
    for policy in policies:
        os.environ["MLX_LM_SPEC_ATTENTION"] = policy
        rows = components(model, base, chat["advice"], args.repeats)
        plain = rows[0][2]
        for name, b, t in rows:
            print(
                f"| {policy} | {name} | {'' if b is None else f'{1e3 * b:.2f}'} | {1e3 * t:.2f} | "
                f"{t / plain:.2f} |",
                flush=True,
            )

    ks = [int(k) for k in args.ks.split(",")]
    tps(model, tok, chat["advice"], 16)  # warm-up
    print(
        "\n| prompt | method | tok/s | vs stock | accepted/drafted | tok/fwd |"
        "\n|---|---|---|---|---|---|"
    )
    for name, prompt in chat.items():
        res, stats = {"stock": []}, {}
        for _ in range(
            args.loop_repeats
        ):  # interleaved: the machine's drift hits every method alike
            res["stock"].append(tps(model, tok, prompt, args.max_tokens)[0])
            for policy in policies:
                os.environ["MLX_LM_SPEC_ATTENTION"] = policy
                for k in ks + ["adaptive", "auto-off"]:
                    m = f"{policy}: assistant " + (f"k={k}" if isinstance(k, int) else k)
                    d = assistant.AssistantDrafter(
                        model,
                        base.net,
                        base.cfg,
                        max_draft=k if isinstance(k, int) else 6,
                        adaptive=not isinstance(k, int),
                        auto_off=k == "auto-off",
                    )
                    v, stats[m] = tps(
                        model, tok, prompt, args.max_tokens, d, k if isinstance(k, int) else 3
                    )
                    res.setdefault(m, []).append(v)
                    if policy != policies[0]:
                        break  # the comparison policy: one row
        stock = statistics.median(res["stock"])
        for m, vals in res.items():
            v = statistics.median(vals)
            st = stats.get(m)
            acc = f"{100 * st.acceptance:.0f}%" if st else ""
            tpf = f"{st.tokens_per_forward:.2f}" if st else "1.00"
            print(f"| {name} | {m} | {v:.1f} | {v / stock:.2f}x | {acc} | {tpf} |", flush=True)


if __name__ == "__main__":
    main()
