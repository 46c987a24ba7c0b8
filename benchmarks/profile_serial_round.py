"""Where the serial loop's time goes, round by round, on the real loop.

    python benchmarks/profile_serial_round.py --standin 10B --device gpu --dtype bfloat16

The drafted workloads of ``bench_suffix.py`` run through ``mlx_lm.generate``
with spec-decode (``suffix`` on the replayed asks, ``ngram`` on the grounded
prompts); the loop's own functions are wrapped with timers (wall time spent
inside each, the consumer's time outside the generator excluded):

- ``draft``: the drafter's proposal (``VerifyLoop._draft``);
- ``build``: the verify forward's graph (``VerifyLoop.forward``, lazy);
- ``wait+accept``: the acceptance rule, whose read-back waits for the
  forward (``sampling.accept``), with the lazy log-probs before it;
- ``rollback``: the caches trimmed to the kept tokens (``ragged.keep``);
- ``emit``: figures, controller, drafter told, tokens yielded (``_emit``);
- ``other``: the rest of a drafting round;

per verified round in ms, after ``--warmup`` untimed passes of each
workload (stock and ours), next to stock's pipelined step (the same
requests, ``stream_generate`` without a drafter) and a synchronous forward
of the widths the rounds ran at (built, evaluated, read back: what a round
cannot go below). Plain steps of our loop (the controller's probes, runs
where nothing was drafted) are counted apart, with their ms per token,
and so are the rounds queued behind a run's last step (checked inside the
run, so their time there is theirs: draft, check, rollback, emit) and
counted among the rounds; the phase columns are the other rounds'.
``--variants`` profiles ours again under other settings of the loop's
environment (e.g. ``MLX_LM_SPEC_WIDTHS=16``: one padded width), each with
its own warm-up and stock turn, one row per workload and variant.
"""

import argparse
import contextlib
import os
import re
import statistics
import time
from collections import defaultdict

import mlx.core as mx
from bench_spec_decode import prompts as single_prompts
from bench_suffix import agent_requests, chat, served
from common import (
    add_device_args,
    add_target_args,
    load_target,
    print_header,
    set_device,
    target_name,
)
from mlx_lm import stream_generate
from profile_batch_round import sync_forward

import mlx_lm_ext
import mlx_lm_spec_decode as sd
from mlx_lm_spec_decode import loop as loop_mod
from mlx_lm_spec_decode import ragged, sampling

PHASES = ("draft", "build", "wait+accept", "rollback", "emit")


def instrument(acc):
    """Wrap the loop's phases; ``acc[name]`` collects seconds, and
    ``acc["widths"]`` each verify's fed width. Returns an undo function."""
    V = loop_mod.VerifyLoop
    saved = [
        (V, n, getattr(V, n))
        for n in ("_draft", "forward", "_emit", "plain", "draft_round", "_early")
    ]
    saved += [(sampling, "accept", sampling.accept), (ragged, "keep", ragged.keep)]
    saved += [(sampling, "window_logprobs", sampling.window_logprobs)]

    def timed(fn, name):
        def wrap(*a, **kw):
            key = name + (" early" if acc["in plain"] else "")
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0

        return wrap

    def timed_gen(fn, name, nest=None, early=True):
        # Only the time inside the generator counts (not its consumer's);
        # ``nest``: the counter raised while it runs (plain runs started
        # inside a round; rounds checked inside a plain run, ``early``).
        def wrap(*a, **kw):
            gen = fn(*a, **kw)
            while True:
                key = name + (" early" if early and acc["in plain"] else "")
                t0 = time.perf_counter()
                if nest:
                    acc[nest] += 1
                try:
                    item = next(gen)
                except StopIteration:
                    return
                finally:
                    if nest:
                        acc[nest] -= 1
                    acc[key] += time.perf_counter() - t0
                yield item

        return wrap

    def forward(self, tokens, *a):
        if tokens.size > 1:
            acc["early widths" if acc["in plain"] else "widths"].append(tokens.size)
        return timed(saved[1][2], "build" if tokens.size > 1 else "plain build")(self, tokens, *a)

    def plain(self, n, *a, **kw):
        # A run inside a drafting round (a probe, nothing drafted) is also
        # inside that round's time: kept apart to take it out again. A
        # round queued behind a run's last step is checked inside the run:
        # its phases are counted apart ("early") and out of the run's time.
        name = "plain nested" if acc["depth"] else "plain"
        return timed_gen(counted(saved[3][2]), name, "in plain", early=False)(self, n, *a, **kw)

    def counted(fn):
        def gen(*a, **kw):
            for item in fn(*a, **kw):
                acc["plain tokens"] += 1
                yield item

        return gen

    def early(self, *a, **kw):
        queued = saved[5][2](self, *a, **kw)
        acc["early rounds"] += queued is not None
        return queued

    V._draft, V.forward = timed(saved[0][2], "draft"), forward
    V._emit, V.plain = timed_gen(saved[2][2], "emit"), plain
    V.draft_round = timed_gen(saved[4][2], "round", "depth")
    V._early = early
    sampling.accept = timed(saved[6][2], "wait+accept")
    ragged.keep = timed(saved[7][2], "rollback")
    sampling.window_logprobs = timed(saved[8][2], "wait+accept")

    def undo():
        for obj, name, fn in saved:
            setattr(obj, name, fn)

    return undo


def generate(model, tok, prompt, max_tokens, drafter=None):
    """(tokens after the first, seconds from the first token on, stats or None)."""
    t0, n = time.perf_counter(), 0
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, draft_model=drafter):
        if n == 0:
            t0 = time.perf_counter()  # decoding from the first token on
        n = r.generation_tokens
    return n - 1, time.perf_counter() - t0, sd.last_stats() if drafter else None


def profile(model, tok, name, requests, max_tokens, make, warmup=1):
    # Untimed first: kernels, graphs and attention plans built on first use
    # of each width and cache length would otherwise land in the rounds.
    for _ in range(warmup):
        drafter = make()
        for p in requests:
            generate(model, tok, p, max_tokens)
            generate(model, tok, p, max_tokens, drafter)
    stock_tokens = stock_s = 0.0
    for p in requests:
        n, s, _ = generate(model, tok, p, max_tokens)
        stock_tokens, stock_s = stock_tokens + n, stock_s + s
    acc = defaultdict(float)
    acc["widths"], acc["early widths"] = [], []
    undo = instrument(acc)
    rounds = tokens = secs = forwards = emitted = 0
    drafter = make()
    try:
        for p in requests:
            n, s, st = generate(model, tok, p, max_tokens, drafter)
            rounds, tokens, secs = rounds + st.draft_rounds, tokens + n, secs + s
            forwards, emitted = forwards + st.forwards, emitted + st.emitted
    finally:
        undo()
    ours_ms = 1e3 * secs / tokens
    stock_ms, tpf = 1e3 * stock_s / stock_tokens, emitted / max(1, forwards)
    return dict(name=name, stock_ms=stock_ms, ours_ms=ours_ms, rounds=rounds, tpf=tpf, acc=acc)


def report(r, sync):
    acc = r["acc"]
    n_early = int(acc["early rounds"])
    n = max(1, r["rounds"] - n_early)
    widths = acc["widths"]
    plain_n = acc["plain tokens"]
    phases = {p: 1e3 * acc[p] / n for p in PHASES}
    early_s = sum(acc[f"{p} early"] for p in PHASES)
    inside_round = 1e3 * (acc["round"] - acc["plain nested"]) / n
    plain_s = acc["plain"] + acc["plain nested"] - early_s
    other = inside_round - sum(phases.values())
    w_mean = statistics.mean(widths) if widths else 0
    sync_ms = statistics.mean(sync[w] for w in widths) if widths else 0
    cells = " | ".join(f"{phases[p]:.2f}" for p in PHASES)
    return (
        f"| {r['name']} | {r['stock_ms']:.2f} | {r['ours_ms']:.2f} ({r['stock_ms'] / r['ours_ms']:.2f}x) "
        f"| {r['rounds']} ({r['tpf']:.2f} tok/fwd) "
        f"| {cells} | {other:.2f} | {inside_round:.2f} | {w_mean:.1f} | {sync_ms:.2f} "
        f"| {inside_round / sync_ms if sync_ms else 0:.2f} "
        f"| {int(plain_n)}, {1e3 * plain_s / max(1, plain_n):.2f} "
        f"| {n_early}, {1e3 * early_s / max(1, n_early):.2f} |"
    )


@contextlib.contextmanager
def settings(variant):
    """The loop's environment set as ``variant`` says ('default': as it is)."""
    # A comma starts the next setting only before NAME= (widths hold commas).
    parts = [] if variant == "default" else re.split(r",(?=[A-Z_]+=)", variant)
    pairs = [kv.split("=", 1) for kv in parts]
    if any(len(kv) != 2 for kv in pairs):
        raise SystemExit(f"--variants: 'default' or NAME=VALUE[,NAME=VALUE], got {variant!r}")
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--agent-max-tokens", type=int, default=64)
    add_device_args(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per workload first")
    p.add_argument(
        "--variants",
        nargs="*",
        default=["default"],
        help="settings to profile ours under, in turn: 'default', or NAME=VALUE[,NAME=VALUE] "
        "of the loop's environment (MLX_LM_SPEC_WIDTHS, MLX_LM_SPEC_ATTENTION, MLX_LM_SPEC_FLUSH)",
    )
    add_target_args(p)
    args = p.parse_args()
    set_device(args)
    print_header()
    mlx_lm_ext.enable("spec-decode")
    model, tok = load_target(args, args.dtype)
    print(f"# {target_name(args, args.dtype)} on {mx.default_device()}, greedy\n", flush=True)
    agent = [chat(tok, t) for t in agent_requests()]
    seen = served(model, tok, agent, args.agent_max_tokens)
    runs = [
        (
            "agent: replayed asks (suffix)",
            agent,
            args.agent_max_tokens,
            lambda: sd.SuffixDrafter(corpus=seen, tree=False),
        ),
    ]
    for name, text in single_prompts():
        if name.startswith("grounded"):
            runs.append(
                (
                    f"{name} (ngram)",
                    [chat(tok, text)],
                    args.max_tokens,
                    lambda: sd.NGramDrafter(tree=False),
                )
            )
    results = []
    for variant in args.variants:
        with settings(variant):
            for name, *rest in runs:
                results.append(profile(model, tok, f"{name}, {variant}", *rest, warmup=args.warmup))
    widths = sorted({w for r in results for w in r["acc"]["widths"] + r["acc"]["early widths"]})
    prefix = list(range(100, 356))  # 256 tokens of cache before each forward
    sync = {w: 1e3 * sync_forward(model, prefix, 1, w, 7) for w in widths}
    print(
        "| workload | stock ms/token | ours ms/token | rounds | "
        + " | ".join(f"{p} ms" for p in PHASES)
        + " | other ms | round ms | mean width | sync forward ms | round / sync"
        + " | plain steps, ms each | rounds behind a step, ms each |"
    )
    print("|" + "---|" * (10 + len(PHASES)))
    for r in results:
        print(report(r, sync), flush=True)
    print(
        "\nsynchronous forward ms by width: "
        + ", ".join(f"{w}: {ms:.2f}" for w, ms in sync.items())
    )


if __name__ == "__main__":
    main()
