"""Where a batched drafting round's time goes, against a synchronous forward of its width.

    python benchmarks/profile_batch_round.py                       # CPU, SmolLM2 float32
    python benchmarks/profile_batch_round.py --device gpu --dtype bfloat16 --standin 10B

In process, no server: for each concurrency C, C grounded prompts (the
answer copies its input; ``--kinds open``: chat prompts; ``grounded,open``
both) decode with mlx-lm's ``BatchGenerator`` (stock) and with
``SpecBatchGenerator`` (the n-gram drafter, as ``mlx_lm.server
--plugin spec-decode`` runs it), one after the other on the same model.
Printed per C:

- tokens/s of both (completion tokens over the decode calls' wall time,
  prompt processing excluded) and their ratio; ``same``: every greedy
  output identical to stock's;
- per call kind (stock's plain step, our plain step, our round at each
  window width W), the call's median, 90th percentile and longest (ms),
  and the seconds all of them took (a few calls that build kernels or
  graphs on first use show in the longest and the total, not the median);
- a round's phases (median ms): ``propose`` (the drafters' lookups, the
  decision), ``wait`` (reading the pending tokens back before building the
  round: the step in flight finishing), ``forward`` (the verify forward evaluated, acceptance read
  back; for a round built ahead of its pending tokens this includes the
  step in flight), ``rest`` (rollback, emission, drafter updates);
- a synchronous forward over ``[C, W]`` on a prefilled cache (built,
  evaluated, argmax read back) at each width the rounds used, and the
  rounds' median over it (the issue's "a round costs one forward").

``--repeats N``: stock and ours decode in turn N times, each on one
generator as a server keeps one, the turns alternating which goes first
(give an even N); the ratio is the medians', each turn's
in brackets. ``--queue K``: a busy server instead of one batch: each of C
clients sends K requests one after another (the pool in turn), a finished
row's slot taken by the next request, and every call timed, prompt
processing included; ``--vary-tokens F`` gives each request its own
budget (seeded, ``--max-tokens`` x (1 ± F)), so that rows end apart as a
server's requests do: with one budget for all, stock's rows end, and new
ones join, together. One batch of C prompts (the default) ends with its
slowest row: rows that finish early leave the rest decoding in a smaller
batch whose step costs about as much on a memory-bound device, so it
gains only what its least-drafted row gains; a server's freed slots take
new requests and it gains what its rows gain on average. ``--control stock`` puts stock in ours' place (what the
machine's drift alone reads), ``--control silent`` our generator with a
drafter that never proposes (its cost where nothing is drafted),
``--control bare`` our generator with drafting off for the whole batch
(the subclass's own cost: mlx-lm's steps through our plumbing).
``--probe 1,4,8``: no decoding; forwards of those widths as a round runs
them (warm, through the round's holey cache, right after a plain step,
widths in turn), and the host's share of a warm one (its graph built and
launched, not waited for).
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch_spec import OPEN, grounded  # noqa: E402
from common import (  # noqa: E402
    add_device_args,
    add_target_args,
    batch_levels,
    load_target,
    print_header,
    set_device,
    target_name,
)

from mlx_lm_spec_decode import NGramDrafter  # noqa: E402
from mlx_lm_spec_decode import batch as batch_mod  # noqa: E402
from mlx_lm_spec_decode import ragged as ragged_mod  # noqa: E402


def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def decode(gen, prompts, max_tokens, inflight=0, parts=None):
    """Drive ``gen`` to the end: each request's tokens, and each decode call's seconds.

    ``inflight`` 0: every prompt at once, a static batch that ends with its
    slowest row; the calls that process prompts are left out. Else at most
    that many requests at once, the next inserted as one finishes (a
    server's clients, each sending its next request when its last one
    ends): every call counts, prompt processing included, as a server's
    clock does; ``parts`` gets mlx-lm's own split of the time (its
    ``BatchStats``: decode steps, prompt processing, the rest; ``gen``
    then needs mlx-lm's ``stats()``)."""
    if not inflight:
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        out, calls = _drive(gen, uids, lambda n: [], every=False)
        return [out[u] for u in uids], calls
    if parts is None:
        return _queued(gen, prompts, max_tokens, inflight)
    host, window = time.thread_time(), []
    with gen.stats() as stats:
        out, calls = _queued(gen, prompts, max_tokens, inflight, window)
    # The calling thread's CPU seconds: what the host spent building and
    # launching work (and the caller's bookkeeping), not its waits.
    stats.host_time = time.thread_time() - host
    stats.calls = len(calls)
    # The busy server's steady state: the calls made while requests still
    # waited for a slot (every slot taken), their seconds and tokens.
    stats.steady = (sum(dt for dt, _ in window), sum(n for _, n in window), len(window))
    parts.append(stats)
    return out, calls


def _queued(gen, prompts, max_tokens, inflight, window=None):
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    queue = list(range(len(prompts)))
    index = {}  # uid -> the prompt's position

    def admit(n):
        take, queue[:n] = queue[:n], []
        if not take:
            return []
        uids = gen.insert([prompts[i] for i in take], max_tokens=[budgets[i] for i in take])
        index.update(zip(uids, take, strict=True))
        return uids

    out, calls = _drive(gen, admit(inflight), admit, True, lambda: bool(queue), window)
    by_prompt = {index[u]: t for u, t in out.items()}
    return [by_prompt[i] for i in range(len(prompts))], calls


def _drive(gen, uids, admit, every, waiting=None, window=None):
    """Call ``gen`` until every request, including those ``admit(n)`` adds as
    ``n`` finish, is done; the seconds of ``every`` call, or of those that
    emit no row's first token. ``window`` gets ``(seconds, tokens)`` of each
    call made while ``waiting()``: requests still queued for a slot."""
    out, left, calls = {u: [] for u in uids}, len(uids), []
    while left:
        busy = window is not None and waiting()
        t = time.perf_counter()
        _, responses = gen.next()
        dt = time.perf_counter() - t
        if every or (responses and all(out[r.uid] for r in responses)):
            calls.append(dt)
        if busy:
            window.append((dt, len(responses)))
        finished = 0
        for r in responses:
            out[r.uid].append(r.token)
            finished += bool(r.finish_reason)
        left -= finished
        for u in admit(finished) if finished else []:
            out[u], left = [], left + 1
    return out, calls


class Recorder:
    """Wraps the generation batch's call kinds to time them, then restores them."""

    def __init__(self):
        self.kind = None
        self.phases = {"propose": [], "wait": [], "forward": [], "rest": []}
        self.kinds = []
        self.reasons = {}  # what each call of ours was, and why
        cls = batch_mod.SpecGenerationBatch
        names = ("_next", "_round", "_propose", "_check", "_decide")
        self.saved = {n: getattr(cls, n) for n in names}
        rec = self

        def read_back(a):
            t = time.perf_counter()
            out = rec.read_back(a)
            rec.t_wait += time.perf_counter() - t
            return out

        def _next(self_):
            rec.kind, rec.t_prop, rec.t_wait, rec.why = "plain", 0.0, 0.0, None
            in_run = self_.plain_left > 0
            t = time.perf_counter()
            out = rec.saved["_next"](self_)
            dt = time.perf_counter() - t
            # ``_next`` clears ``on`` where drafting is off at this size.
            if rec.kind != "plain":
                why = "round"
            elif not self_.on:
                why = "plain (drafting off)"
            else:
                why = rec.why or ("plain (in a run)" if in_run else "plain (decided)")
            rec.reasons[why] = rec.reasons.get(why, 0) + 1
            # Plain calls timed by why they were plain: which of them cost more than stock's.
            rec.kinds.append((rec.kind if why == "round" else why, dt, len(out)))
            return out

        def _decide(self_, B, drafts, ahead):
            g = rec.saved["_decide"](self_, B, drafts, ahead)
            if g == 0:
                rec.why = "plain (declined)" if self_.misses == 0 else "plain (no proposals)"
            return g

        def _propose(self_, *a):
            t = time.perf_counter()
            out = rec.saved["_propose"](self_, *a)
            rec.t_prop += time.perf_counter() - t
            return out

        def _round(self_, pending, drafts, *a):
            w = 1 + max(len(d) for d in drafts)
            rec.kind = f"round W={batch_mod.target_mod.padded_width(w, self_.spec.ctl.widths, len(drafts))}"
            rec.t_check, w0 = 0.0, rec.t_wait
            t = time.perf_counter()
            out = rec.saved["_round"](self_, pending, drafts, *a)
            whole = time.perf_counter() - t
            rec.phases["propose"].append(rec.t_prop)
            rec.phases["wait"].append(rec.t_wait)
            rec.phases["forward"].append(rec.t_check)
            rec.phases["rest"].append(whole - rec.t_check - (rec.t_wait - w0))
            return out

        def _check(self_, *a):
            t = time.perf_counter()
            out = rec.saved["_check"](self_, *a)
            mx.eval(out[0])
            rec.t_check += time.perf_counter() - t
            return out

        for n, f in (
            ("_next", _next),
            ("_round", _round),
            ("_propose", _propose),
            ("_decide", _decide),
        ):
            setattr(cls, n, f)
        cls._check = _check
        self.read_back = batch_mod.read_back
        batch_mod.read_back = read_back

    def restore(self):
        for n, f in self.saved.items():
            setattr(batch_mod.SpecGenerationBatch, n, f)
        batch_mod.read_back = self.read_back


def print_steady(parts):
    """The busy server's steady state (``--queue``): tokens/s over the calls
    made while requests still waited for a slot. The rest of a queued run is
    its drain, rows leaving one by one with none to take their slots: a
    row left alone decodes at a full step's cost, which a server with
    waiting requests never pays, and rows that draft well leave early."""
    if not parts["stock"]:  # one batch, no queue
        return
    rates = {k: [r.steady[1] / max(r.steady[0], 1e-9) for r in v] for k, v in parts.items()}
    if not all(rates["stock"]):  # --queue 1: no request ever waited
        return
    s, o = statistics.median(rates["stock"]), statistics.median(rates["ours"])
    turns = ", ".join(f"{b / a:.2f}x" for a, b in zip(rates["stock"], rates["ours"], strict=True))
    n = sum(r.steady[2] for r in parts["ours"]) / sum(r.calls for r in parts["ours"])
    print(f"steady state (requests waiting, {n:.0%} of ours' calls): stock {s:.1f} tok/s, "
          f"ours {o:.1f} tok/s, {o / s:.2f}x (turns: {turns})")  # fmt: skip


def print_parts(parts):
    """Where each method's queued turns spent their time, by mlx-lm's own
    counters: its decode steps (ours: plain steps and rounds), prompt
    processing, and the rest of its calls (rows joining and leaving); and
    the calling thread's CPU time per call (host work, waits excluded)."""
    if not any(parts.values()):
        return
    print("| method | wall s | decode s | prompts s | rest s | steps | host ms/call |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    for name, runs in parts.items():
        wall, dec, pro, host = (
            sum(getattr(r, k) for r in runs)
            for k in ("wall_time", "decode_time", "prompt_time", "host_time")
        )
        steps, calls = sum(r.generation_steps for r in runs), sum(r.calls for r in runs)
        print(f"| {name} | {wall:.2f} | {dec:.2f} | {pro:.2f} | {wall - dec - pro:.2f} | "
              f"{steps} | {1e3 * host / max(calls, 1):.2f} |")  # fmt: skip


def sync_forward(model, prompt, B, W, repeats):
    """Median seconds of a forward over ``[B, W]`` on a prefilled cache, read back."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt] * B, mx.uint32), cache=cache))
    x = mx.array([[prompt[-1]] * W] * B, mx.uint32)
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        mx.argmax(model(x, cache=cache), axis=-1).tolist()
        times.append(time.perf_counter() - t)
        trim_prompt_cache(cache, W)
    return statistics.median(times[2:])


def probe(model, prompt, B, widths, repeats=10):
    """Where a round's forward loses time against a warm synchronous forward:
    per width W, the median ms of a ``[B, W]`` forward read back (``warm``: the
    same shape again and again on a batch cache; ``ragged``: through the
    round's cache with holes and its attention; ``after step``: each right
    after a ``[B, 1]`` step, as rounds follow plain steps; ``host: build and
    launch``: a warm one's graph built and handed to the device
    (``mx.async_eval`` returned), not waited for: where this nears ``warm``,
    the step is bound by the host (graph building, kernel launches), not by
    the device's memory traffic, and a pipelined step cannot beat it (``ragged
    host``: the same through the round's cache with holes); on the CPU the
    device is the host's own cores and it reads near the forward;
    ``mixed``: the widths in turn, each after a step, as an adaptive draft
    length runs)."""
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_spec_decode import target as target_mod

    def fresh(holes):
        caches = [BatchKVCache([0] * B) for _ in model.layers]
        mx.eval(model(mx.array([prompt] * B, mx.uint32), cache=caches))
        if not holes:
            return caches
        caches = ragged_mod.ragged(caches)
        model(mx.array([[prompt[-1]] * 4] * B, mx.uint32), cache=caches)
        mx.eval([c.state for c in caches])
        ragged_mod.rollback(caches, [1 + (i % 3) for i in range(B)])
        return caches

    def fwd(caches, W, policy=None, launch=False):
        x = mx.array([[prompt[-1]] * W] * B, mx.uint32)
        t = time.perf_counter()
        with target_mod.verify_attention(model, W, policy or "explicit"):
            y = mx.argmax(model(x, cache=caches), axis=-1)
        if launch:  # the host's part only: built and handed over
            mx.async_eval(y)
            dt = time.perf_counter() - t
            mx.eval(y)
        else:
            y.tolist()
            dt = time.perf_counter() - t
        for c in caches:
            c.trim(W)
        return dt

    def step(caches):
        fwd(caches, 1)

    rows = {}
    for name, holes, before, launch in (
        ("warm", False, False, False),
        ("ragged", True, False, False),
        ("after step", False, True, False),
        ("ragged after step", True, True, False),
        ("host: build and launch", False, False, True),
        ("ragged host: build and launch", True, False, True),
    ):
        for W in widths:
            caches = fresh(holes)
            ts = []
            for _ in range(repeats + 2):
                if before:
                    step(caches)
                ts.append(fwd(caches, W, launch=launch))
            rows.setdefault(name, {})[W] = statistics.median(ts[2:])
    caches = fresh(False)
    mixed = {W: [] for W in widths}
    for _ in range(repeats + 1):
        for W in widths:
            step(caches)
            mixed[W].append(fwd(caches, W))
    rows["mixed after step"] = {W: statistics.median(ts[1:]) for W, ts in mixed.items()}
    print(f"\n## forward probe B={B}: median ms over {repeats}")
    print("| forward | " + " | ".join(f"W={W}" for W in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name, by in rows.items():
        print(f"| {name} | " + " | ".join(f"{1e3 * by[W]:.2f}" for W in widths) + " |")


class Silent(NGramDrafter):
    """A drafter that never proposes: our generator's cost where nothing is drafted."""

    def draft(self, ctx, n):
        return [], None


def budgets(n, max_tokens, vary):
    """Each of ``n`` queued requests' token budget: ``max_tokens``, or with
    ``vary`` > 0 drawn (seeded, the same for stock and ours) from
    ``max_tokens * (1 ± vary)``, so that rows end apart as a server's
    requests do, not all at once."""
    if not vary:
        return max_tokens
    rng = random.Random(0)
    lo, hi = max(1, round(max_tokens * (1 - vary))), round(max_tokens * (1 + vary))
    return [rng.randint(lo, hi) for _ in range(n)]


def run(
    model,
    tok,
    C,
    max_tokens,
    tree,
    kind="grounded",
    repeats=1,
    control="",
    queue=0,
    vary=0.0,
    prefill=None,
):
    """Stock and ours in turn, ``repeats`` times (ours on one generator, as a
    server keeps one: what its controller learnt carries over); the ratio of
    the medians, and each turn's. ``queue``: each of C clients sends that
    many requests one after another (the kind's pool in turn), else the
    first C prompts decode as one batch. ``prefill``: every generator's
    ``prefill_step_size`` (None: mlx-lm's)."""
    pool = grounded() if kind == "grounded" else OPEN
    chats = [pool[i % len(pool)] for i in range(C * queue)] if queue else pool[:C]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in chats
    ]
    inflight = C if queue else 0
    max_tokens = budgets(len(prompts), max_tokens, vary if queue else 0.0)
    # Stock keeps one generator across turns, as ours does and as a server
    # does: a fresh one per turn read ours' plumbing as 1.08-1.18x of stock's.
    # Every generator is built after the warm-up's kernels, one after the
    # other: on the H100 a stock generator built after ours' warm-up read
    # 1.16x of one built before it (--control stock).
    drafter = Silent(tree=tree) if control == "silent" else NGramDrafter(tree=tree)
    kw = {} if prefill is None else {"prefill_step_size": prefill}
    decode(
        batch_mod.SpecBatchGenerator(model, drafter, 3, drafter.max_draft, **kw), prompts[:C], 32
    )
    base = BatchGenerator(model, **kw)
    twin = BatchGenerator(model, **kw) if control == "stock" else None
    gen = batch_mod.SpecBatchGenerator(model, drafter, 3, drafter.max_draft, **kw)
    for g in (base, twin):
        if g is not None:
            decode(g, prompts[:C], 8)  # warm up, as ours' warm-up did
    if control == "bare":
        gen.spec.no_draft = "--control bare"
    rec = Recorder()
    s_rates, o_rates, stock_calls, ours_calls, same = [], [], [], [], True
    parts = {"stock": [], "ours": []}  # mlx-lm's split of each queued turn's time
    emitted = {"stock plain step": 0, "ours every call": 0}  # tokens, by kind of call
    other = twin or gen
    try:
        for r in range(repeats):
            # Turns alternate which goes first: on the H100 the second of two
            # identical stock generators read 1.04-1.06x of the first.
            order = ("stock", "ours") if r % 2 == 0 else ("ours", "stock")
            out = {}
            for name in order:
                g = base if name == "stock" else other
                out[name] = decode(g, prompts, max_tokens, inflight, parts[name])
            (stock, calls), (ours, our_calls) = out["stock"], out["ours"]
            stock_calls += calls
            emitted["stock plain step"] += sum(len(t) for t in stock)
            s_rates.append(sum(len(t) for t in stock) / sum(calls))
            o_rates.append(sum(len(t) for t in ours) / sum(our_calls))
            if other is gen:
                ours_calls += our_calls
                emitted["ours every call"] += sum(len(t) for t in ours)
            same = same and ours == stock
    finally:
        rec.restore()
    s_tps, o_tps = statistics.median(s_rates), statistics.median(o_rates)
    turns = ", ".join(f"{o / s:.2f}x" for s, o in zip(s_rates, o_rates, strict=True))
    print(f"\n## {kind} C={C}: stock {s_tps:.1f} tok/s, ours {o_tps:.1f} tok/s, {o_tps / s_tps:.2f}x, "
          f"same={'yes' if same else 'no'} (turns: {turns})")  # fmt: skip
    print_steady(parts)
    # Every call of each, as the caller's clock saw it (prompt processing included).
    by = {"stock plain step": stock_calls, "ours every call": ours_calls}
    for kind, t, n in rec.kinds:
        by.setdefault("ours " + kind, []).append(t)
        emitted["ours " + kind] = emitted.get("ours " + kind, 0) + n
    # tok/call: what a call returned (a plain step: one token a row; a
    # round: each row's pending token and accepted drafts).
    print("| call | n | tok/call | median ms | p90 ms | max ms | total s | x sync forward of its width |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    for kind, ts in sorted(by.items()):
        if not ts:  # --control stock: no call of ours
            continue
        W = int(kind.split("W=")[1]) if "W=" in kind else 1
        ref = sync_forward(model, prompts[0], C, W, 10)
        print(f"| {kind} | {len(ts)} | {emitted[kind] / max(len(ts), 1):.2f} | "
              f"{1e3 * statistics.median(ts):.2f} | "
              f"{1e3 * q(ts, 0.9):.2f} | {1e3 * max(ts):.1f} | {sum(ts):.2f} | "
              f"{statistics.median(ts) / ref:.2f} (sync {1e3 * ref:.2f}) |")  # fmt: skip
    print("calls: " + ", ".join(f"{k} {v}" for k, v in sorted(rec.reasons.items())))
    print_parts(parts)
    if rec.phases["forward"]:
        print("| round phase | median ms | p90 ms |\n|---|---|---|")
        for name, ts in rec.phases.items():
            print(f"| {name} | {1e3 * statistics.median(ts):.2f} | {1e3 * q(ts, 0.9):.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(ap, "cpu")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-tree", choices=["auto", "off"], default="auto")
    ap.add_argument("--kinds", default="grounded", help="grounded and/or open prompts")
    ap.add_argument(
        "--control",
        choices=["stock", "silent", "bare"],
        default="",
        help="a control run in ours' place: stock again (the order's effect), our "
        "generator with a drafter that never proposes (its cost without drafts), or "
        "our generator with drafting off (its plumbing's cost)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="turns of stock and ours per cell")
    ap.add_argument(
        "--queue",
        type=int,
        default=0,
        metavar="K",
        help="each of C clients sends K requests one after another, a row's slot "
        "refilled as it finishes (a busy server; every call timed, prompt processing "
        "included); 0: C prompts decode as one batch, which ends with its slowest row",
    )
    ap.add_argument(
        "--vary-tokens",
        type=float,
        default=0.0,
        metavar="F",
        help="with --queue: each request's max tokens drawn (seeded) from "
        "--max-tokens x (1 ± F), so that rows end apart as a server's requests do "
        "(0: every request the same, so stock's rows end and are refilled together)",
    )
    ap.add_argument(
        "--prefill-step-size",
        type=int,
        default=None,
        metavar="N",
        help="every generator's prompt chunk in tokens (mlx-lm's BatchGenerator and "
        "mlx_lm.server's option; default mlx-lm's 2048): the wide stand-ins' MLP "
        "activations over 8 rows of 2048 tokens outgrow an 80 GB card at 20B and 30B, "
        "where a real model of that size, with MLPs ~20x narrower, fits",
    )
    ap.add_argument(
        "--compact-holes",
        type=int,
        default=None,
        metavar="N",
        help="squeeze a batch's cache once a row has N holes (default: ragged.COMPACT_HOLES)",
    )
    ap.add_argument(
        "--probe",
        default="",
        metavar="WIDTHS",
        help="instead of decoding, time forwards of these widths (e.g. 1,4,8,11) "
        "in the ways a round runs them",
    )
    add_target_args(ap)
    args = ap.parse_args()
    levels, kinds = batch_levels(ap, args)
    if args.compact_holes is not None:
        ragged_mod.COMPACT_HOLES = args.compact_holes
    set_device(args)
    print_header()
    model, tok = load_target(args, args.dtype)
    print(
        f"# {target_name(args, args.dtype)} on {args.device}, {args.max_tokens} tokens, "
        f"--draft-tree {args.draft_tree}"
    )
    if args.probe:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": grounded()[0]}], add_generation_prompt=True
        )
        for C in levels:
            probe(model, prompt, C, [int(w) for w in args.probe.split(",")])
        return
    for kind in kinds:
        for C in levels:
            run(
                model,
                tok,
                C,
                args.max_tokens,
                args.draft_tree != "off",
                kind,
                args.repeats,
                args.control,
                args.queue,
                args.vary_tokens,
                args.prefill_step_size,
            )


if __name__ == "__main__":
    main()
