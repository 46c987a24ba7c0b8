"""The serial loop's plain steps against mlx-lm's own, step by step.

    python benchmarks/profile_plain_steps.py --standin 10B --device gpu --dtype bfloat16

Where drafting does not pay, spec-decode must decode at stock's speed. On
the open prompts of ``bench_spec_decode.py`` (greedy, ``--max-tokens``),
each after ``--warmup`` untimed passes, best of ``--repeats``:

- ``bare``: a pipelined loop over the model alone, as mlx-lm's
  ``generate_step`` runs (the next step's graph built from the lazy token
  before this one is read), with the host's time per step split into
  building the graph (``build``) and waiting for the token (``wait``);
- ``stock``: ``stream_generate`` without a drafter;
- ``silent``: spec-decode with a free drafter that never proposes: the
  loop's plain path alone, its drafter asked after every token;
- ``ngram``: spec-decode with its default n-gram drafter.

Each row gives ms per token and its ratio to ``stock``; spec-decode's rows
add the wall time per token spent inside the loop's own step (``step()``:
the graph), in the drafter (``accept`` and the proposal after each token),
and the rounds and plain steps the loop ran. Where ``bare``'s build is near
its step time, the host bounds a step and any host work adds to it.
``--cprofile N`` then runs stock, ``silent`` and ``ngram`` once more on the
first open prompt under ``cProfile`` and prints each one's N functions of
most own time, in µs per token: where the loop's host time goes.
"""

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import mlx.core as mx
from bench_spec_decode import prompts
from bench_suffix import chat
from common import (
    add_device_args,
    add_target_args,
    load_target,
    print_header,
    set_device,
    target_name,
)
from mlx_lm import stream_generate

import mlx_lm_ext
import mlx_lm_spec_decode as sd
from mlx_lm_spec_decode import loop as loop_mod
from mlx_lm_spec_decode.drafter import Drafter


class Silent(Drafter):
    """A free drafter that never proposes: what the loop costs where
    nothing is drafted."""

    name = "silent"

    def draft(self, ctx, n):
        return [], None


def bare(model, prompt, max_tokens):
    """(ms per token, build ms, wait ms) of a pipelined loop over the model."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array(prompt, mx.uint32)
    model(ids[None, :-1], cache=cache)
    mx.eval([c.state for c in cache])

    def step(y):
        logits = model(y[None], cache=cache)[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(lp, axis=-1), lp

    y, lp = step(ids[-1:])
    mx.async_eval(y, lp)
    build = wait = 0.0
    t0 = time.perf_counter()
    for _ in range(max_tokens):
        t = time.perf_counter()
        nxt = step(y)
        mx.async_eval(*nxt)
        t1 = time.perf_counter()
        y.item()
        t2 = time.perf_counter()
        build, wait = build + t1 - t, wait + t2 - t1
        y, lp = nxt
    total = time.perf_counter() - t0
    return 1e3 * total / max_tokens, 1e3 * build / max_tokens, 1e3 * wait / max_tokens


def timed(model, tok, prompt, max_tokens, drafter=None):
    """(ms per token after the first, tokens, stats or None) through
    ``stream_generate``: to the last token, as mlx-lm's ``generation_tps``
    (not the generator's close, where spec-decode feeds the last token so
    that the prompt cache holds every yielded one)."""
    t0 = t1 = time.perf_counter()
    n = 0
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, draft_model=drafter):
        t1 = time.perf_counter()
        if n == 0:
            t0 = t1
        n = r.generation_tokens
    ms = 1e3 * (t1 - t0) / max(1, n - 1)
    return ms, n, sd.last_stats() if drafter is not None else None


def instrument(acc):
    """Wall time inside the loop's step and its drafter calls, into ``acc``;
    returns the function that undoes it."""
    Loop = loop_mod.VerifyLoop
    saved = [(Loop, name, getattr(Loop, name)) for name in ("step", "_proposal")]

    def wrap(fn, key):
        def inner(self, *a, **kw):
            t = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                acc[key] += time.perf_counter() - t

        return inner

    for obj, name, fn in saved:
        setattr(obj, name, wrap(fn, name))

    def undo():
        for obj, name, fn in saved:
            setattr(obj, name, fn)

    return undo


def spec_row(model, tok, prompt, max_tokens, make, repeats):
    best = None
    for _ in range(repeats):
        acc = defaultdict(float)
        undo = instrument(acc)
        try:
            ms, n, st = timed(model, tok, prompt, max_tokens, make())
        finally:
            undo()
        if best is None or ms < best[0]:
            best = (ms, n, st, acc)
    ms, n, st, acc = best
    per = {k: 1e3 * v / max(1, n) for k, v in acc.items()}
    return ms, per, st


def profile(model, tok, name, prompt, args):
    for _ in range(args.warmup):
        timed(model, tok, prompt, args.max_tokens)
        timed(model, tok, prompt, args.max_tokens, Silent())
        timed(model, tok, prompt, args.max_tokens, sd.NGramDrafter())
        bare(model, prompt, args.max_tokens)
    b = min(bare(model, prompt, args.max_tokens) for _ in range(args.repeats))
    stock = min(timed(model, tok, prompt, args.max_tokens)[0] for _ in range(args.repeats))
    rows = [
        f"| {name} | bare | {b[0]:.2f} | {stock / b[0]:.3f}x | build {b[1]:.2f}, wait {b[2]:.2f} | - |"
    ]
    rows.append(f"| {name} | stock | {stock:.2f} | 1.000x | - | - |")
    for label, make in (("silent", Silent), ("ngram", sd.NGramDrafter)):
        ms, per, st = spec_row(model, tok, prompt, args.max_tokens, make, args.repeats)
        where = f"step {per.get('step', 0):.2f}, proposal {per.get('_proposal', 0):.3f}"
        counts = f"{st.draft_rounds} rounds, {st.forwards} forwards, {st.emitted} tokens"
        rows.append(f"| {name} | {label} | {ms:.2f} | {stock / ms:.3f}x | {where} | {counts} |")
    return rows


def host_profile(model, tok, prompt, max_tokens, top):
    """Each method's ``top`` functions by own time under cProfile, µs per token."""
    for label, make in (("stock", lambda: None), ("silent", Silent), ("ngram", sd.NGramDrafter)):
        prof = cProfile.Profile()
        prof.enable()
        _, n, _ = timed(model, tok, prompt, max_tokens, make())
        prof.disable()
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
        print(f"\n{label}: function, calls, own µs per token, with callees µs per token")
        for (path, line, fn), (_, calls, own, cum, _) in rows:
            where = f"{path.rsplit('/', 1)[-1]}:{line}({fn})"
            print(f"  {where}, {calls}, {1e6 * own / n:.1f}, {1e6 * cum / n:.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per prompt first")
    p.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="then N functions of each under cProfile",
    )
    add_device_args(p)
    add_target_args(p)
    args = p.parse_args()
    set_device(args)
    print_header()
    mlx_lm_ext.enable("spec-decode")
    model, tok = load_target(args, args.dtype)
    print(f"# {target_name(args, args.dtype)} on {mx.default_device()}, greedy\n", flush=True)
    print("| prompt | loop | ms/token | vs stock | host ms/token | loop's counts |")
    print("|---|---|---|---|---|---|")
    opened = []
    for name, prompt in prompts():
        if name.startswith("open"):
            ids = chat(tok, prompt)
            opened.append(ids)
            for row in profile(model, tok, name, ids, args):
                print(row, flush=True)
    if args.cprofile:
        host_profile(model, tok, opened[0], args.max_tokens, args.cprofile)


if __name__ == "__main__":
    main()
