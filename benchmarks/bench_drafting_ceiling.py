"""How fast drafting by copying could possibly be on the spec-decode
workloads: a ceiling from the model's own greedy outputs and this machine's
measured verify costs.

    python benchmarks/bench_drafting_ceiling.py
    python benchmarks/bench_drafting_ceiling.py --device gpu --dtype bfloat16

The n-gram and suffix drafters copy: they find where the history's last
tokens occurred before (in the prompt, the output so far, or for ``suffix``
earlier requests) and propose what followed. This script replays each
workload's real output with an oracle that does the same but knows the
output: each round it drafts exactly the tokens that will be kept, from the
earlier occurrence that agrees longest, and pads the window to the cheapest
measured width that holds them (nothing drafted is ever rejected). With its
context limited to what our drafters need (``n >= 2``: the last two tokens
occurred before), to one token (``n >= 1``), and unlimited (``any``: the
longest copy from anywhere, with no context at all), it gives tokens per
forward and the speed-up over plain decoding that no copying drafter can
pass on this machine: a real drafter also proposes tokens that fail, and
must pick among occurrences without knowing the output. A fourth column
(``n-gram drafts``) takes the n-gram drafter's own proposal at each
position instead (the latest occurrence of the longest suffix, as
``--drafter ngram`` finds it) and lets the oracle choose only how many of
its tokens to verify: what that drafter could reach with a perfect choice
of draft length. A fifth (``n-gram tree``) takes the drafter's own token
tree at each position as a memory-bound device gets it (verify columns
priced free, a verify at ``--flat-verify`` steps: earlier occurrences and
one-token contexts too) and the 15 nodes the serial loop would verify of
it (``tree.select`` at the loop's prior continuation rate); the longest of
its paths that holds is kept. Its rounds are the drafter's own: one runs
wherever the drafter proposes, a wrong guess paying its window, and only
there.

Costs are measured here: a forward over ``[B, W]`` after a 512-token cache
(median of ``--reps``), in plain steps of the same batch size. With
``--flat-verify X`` nothing is measured: a verify forward of any width
costs ``X`` plain steps of its batch size, as on a memory-bound device
(``X = 1``: a round as cheap as a step, the ceiling of such a device; the
outputs replayed are the model's, so a CPU run of SmolLM2 in float32 gives
the ceiling of the stand-in, which predicts the same tokens). Serial
workloads run at B = 1; the batched server's pools in a closed loop of C
clients (a finished request's row is taken by the next), where each
round's window is the same width for every row, chosen by the oracle for
the most tokens per second this round, and stock runs one token per row
per step. The pools run four times over and the clock stops when the queue
runs dry: the steady state, without the batch draining at the end (there
a greedy oracle leaves stragglers that stock, whose rows finish together,
does not). Prefill is left out of both sides.

Workloads: the grounded and open prompts of ``bench_spec_decode.py`` (96
tokens), the two agent replays of ``bench_suffix.py`` (64 tokens a request;
the earlier requests' prompts and outputs are there to copy from), and the
grounded and open pools of ``bench_batch_spec.py`` (128 tokens).
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from bench_batch_spec import OPEN, grounded
from bench_spec_decode import prompts as single_prompts
from bench_suffix import NEAR_WORDINGS, agent_requests, chat
from common import (
    add_device_args,
    add_target_args,
    load_target,
    print_header,
    set_device,
    target_name,
)
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_lm_spec_decode import DraftContext, NGramDrafter
from mlx_lm_spec_decode import tree as tree_mod
from mlx_lm_spec_decode.tree_verify import TreeRounds

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
# (column, n): the oracle's copies preceded by n matching tokens; None: the
# n-gram drafter's proposals, of which the oracle picks how many to verify.
CONTEXTS = (
    ("n >= 2", 2),
    ("n >= 1", 1),
    ("any", 0),
    ("n-gram drafts", None),
    ("n-gram tree", "tree"),
)


def header(first):
    """A results table's two header lines: ``first`` columns, then one per context."""
    cells = " | ".join(f"{c}: tok/fwd, ceiling" for c, _ in CONTEXTS)
    return f"| {first} | {cells} |\n|---|---|" + "---|" * len(CONTEXTS)


def greedy(model, prompt, max_tokens):
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(tok) for tok, _ in steps]


def copy_lengths(context, output, n, cap):
    """For each output position i: how many of ``output[i:]`` the best earlier
    occurrence copies, among those preceded by the same ``n`` tokens as
    position i (``n = 0``: any occurrence), at most ``cap``."""
    full = np.asarray(list(context) + list(output), np.int64)
    base, lengths = len(context), []
    for i in range(len(output)):
        j = base + i
        starts = np.nonzero(full[:j] == full[j])[0]  # the first token must agree
        for back in range(1, n + 1):
            starts = starts[
                (starts >= back) & (full[np.maximum(starts - back, 0)] == full[j - back])
            ]
        best = 0
        for s in starts:
            k = 1
            while k < cap and j + k < len(full) and full[s + k] == full[j + k]:
                k += 1
            best = max(best, k)
            if best == cap:
                break
        lengths.append(best)
    return lengths


def ngram_lengths(context, output, cap):
    """For each output position i: how many of ``output[i:]`` the n-gram
    drafter's proposal there (``cap`` tokens) gets right, with the index
    the drafter builds (its default n-gram lengths)."""
    (index,), lengths = NGramDrafter(tree=False).make_cache(), []  # chains' contexts
    index.extend(context)
    for i, tok in enumerate(output):
        draft = index.lookup(cap)
        k = 0
        while k < len(draft) and i + k < len(output) and draft[k] == output[i + k]:
            k += 1
        lengths.append(k)
        index.extend([tok])
    return lengths


def tree_lengths(context, output, cap, verify=1.0):
    """For each output position i: how far the deepest path of the n-gram
    drafter's token tree there agrees with ``output[i:]``, of the ``cap``
    nodes the serial loop verifies where columns are free and a verify
    costs ``verify`` plain steps; None where the drafter proposes nothing
    (its rounds are its own: ``simulate(..., own=True)`` charges them)."""
    drafter, price, lengths = NGramDrafter(), (verify, 0.0), []
    ctx = DraftContext(None, [], drafter.make_cache(), verify_cost=price)
    drafter.prefill(ctx, list(context))
    acc, rej = TreeRounds.PRIOR
    for i, tok in enumerate(output):
        paths, k = drafter.draft_tree(ctx, cap), 0
        if not paths:
            lengths.append(None)
            drafter.accept(ctx, [tok], 0)
            continue
        tokens, parents, shares = tree_mod.trie(paths)
        probs = tree_mod.estimates(parents, shares, acc / (acc + rej))
        keep = set(tree_mod.select(parents, probs, cap, price))
        kids, node = tree_mod.children(parents), 0
        while i + k < len(output):
            nxt = [c for c in kids[node] if c in keep and tokens[c] == output[i + k]]
            if not nxt:
                break
            node, k = nxt[0], k + 1
        lengths.append(k)
        drafter.accept(ctx, [tok], 0)
    return lengths


def lengths_for(context, output, n, cap, verify=1.0):
    """``copy_lengths``, or the drafter's own: ``ngram_lengths`` for the
    column whose ``n`` is None, ``tree_lengths`` (at ``verify``) for ``"tree"``."""
    if n is None:
        return ngram_lengths(context, output, cap)
    if n == "tree":
        return tree_lengths(context, output, cap, verify)
    return copy_lengths(context, output, n, cap)


def forward_costs(model, batches, prefix=512, reps=5):
    """Median seconds of one forward over ``[B, W]`` for each B and W: read
    back before the next (a verify round), except W = 1, timed as mlx-lm
    decodes (each step built while the previous one runs), which is what
    stock pays and what a round with nothing to draft pays. Every cell is
    timed once per pass, ``reps`` passes after a warm-up one, so that a
    change in the machine's load moves all cells alike."""
    caches, times = {}, {}
    for B in batches:
        caches[B] = make_prompt_cache(model)
        mx.eval(model(mx.tile(mx.arange(100, 100 + prefix)[None], (B, 1)), cache=caches[B]))
    for rep in range(reps + 1):
        for B in batches:
            cache = caches[B]
            for W in WIDTHS[1:]:
                toks = mx.tile(mx.arange(200, 200 + W)[None], (B, 1))
                t0 = time.perf_counter()
                mx.eval(mx.argmax(model(toks, cache=cache), axis=-1))
                if rep:  # the first pass warms each shape
                    times.setdefault((B, W), []).append(time.perf_counter() - t0)
                trim_prompt_cache(cache, W)
            step = pipelined_step(model, cache, B)
            if rep:
                times.setdefault((B, 1), []).append(step)
    return {k: statistics.median(v) for k, v in times.items()}


def flat_costs(batches, verify):
    """Costs in plain steps where a verify forward over any width costs ``verify``."""
    return {(B, w): 1.0 if w == 1 else verify for B in batches for w in WIDTHS}


def pipelined_step(model, cache, B, steps=16):
    """Seconds per step of ``steps`` greedy steps, each built and started
    before the previous one is read back."""
    y = mx.full((B, 1), 200, mx.uint32)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1).astype(mx.uint32)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    seconds = (time.perf_counter() - t0) / steps
    trim_prompt_cache(cache, steps)
    return seconds


def simulate(lengths, C, cost, laps=1, own=False):
    """Closed loop of C clients over the pool ``lengths`` (each request's
    per-position copy lengths) run ``laps`` times: seconds for stock over
    those for the oracle, and the oracle's tokens per row-forward. With
    ``laps > 1`` the clock stops when the queue runs dry (the steady state:
    no batch draining at the end). ``own``: the lengths are a drafter's,
    None where it proposed nothing; a round runs whenever a row proposes
    (a guess that fails still pays its window) and only then."""

    def run(oracle):
        queue = [i for _ in range(laps) for i in range(len(lengths))]
        rows, secs, tokens, fwd = [], 0.0, 0, 0
        while rows or queue:
            while queue and len(rows) < C:
                rows.append([queue.pop(0), 0])
            if laps > 1 and not queue and len(rows) < C:
                break
            B, best = len(rows), (1, [1] * len(rows))
            here = [lengths[r][p] for r, p in rows]
            if oracle and not (own and all(k is None for k in here)):
                # The width with the most tokens per second this round.
                rate, widths = 0.0, WIDTHS[1:] if own else WIDTHS
                for W in widths:
                    take = [
                        1 + min(k or 0, W - 1, len(lengths[r]) - p - 1)
                        for k, (r, p) in zip(here, rows, strict=True)
                    ]
                    if sum(take) / cost[B, W] > rate:
                        rate, best = sum(take) / cost[B, W], (W, take)
            W, take = best
            secs += cost[B, W]
            tokens += sum(take)
            fwd += B
            for row, t in zip(rows, take, strict=True):
                row[1] += t
            rows = [r for r in rows if r[1] < len(lengths[r[0]])]
        return tokens / secs, tokens / fwd

    stock, _ = run(False)
    spec, tpf = run(True)
    return spec / stock, tpf


def nearest_batch(B, batches):
    return min((b for b in batches if b >= B), default=max(batches))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument(
        "--flat-verify",
        type=float,
        default=None,
        metavar="X",
        help="measure no costs: a verify forward of any width costs X plain steps "
        "(a memory-bound device; 1: the ceiling there)",
    )
    add_target_args(p)
    args = p.parse_args()
    set_device(args)
    print_header()
    model, tok = load_target(args, args.dtype)
    levels = [int(c) for c in args.concurrency.split(",")]
    batches = sorted(set(levels))
    cap = max(WIDTHS) - 1
    verify = 1.0 if args.flat_verify is None else args.flat_verify  # the tree's price

    t0 = time.perf_counter()
    if args.flat_verify is None:
        costs = forward_costs(model, batches, reps=args.reps)
    else:
        costs = flat_costs(batches, args.flat_verify)
    print(
        f"# {target_name(args, args.dtype)} on {mx.default_device()}: forward over [B, W] in plain steps of B rows"
        + (
            ""
            if args.flat_verify is None
            else f" (given, not measured: --flat-verify {args.flat_verify})"
        )
    )
    print("\n| B | step ms | " + " | ".join(f"W={w}" for w in WIDTHS) + " |")
    print("|---|---|" + "---|" * len(WIDTHS))
    for B in batches:
        cells = " | ".join(f"{costs[B, w] / costs[B, 1]:.2f}" for w in WIDTHS)
        step = "-" if args.flat_verify is not None else f"{1e3 * costs[B, 1]:.1f}"
        print(f"| {B} | {step} | {cells} |")
    print(f"\n(costs taken in {time.perf_counter() - t0:.0f} s)\n", flush=True)

    # Serial workloads: (name, prompts). A replay's request may copy from the
    # prompts and outputs before it (the corpus).
    serial = [(name, [chat(tok, text)]) for name, text in single_prompts()]
    serial.append(("agent: repeated asks", [chat(tok, t) for t in agent_requests()]))
    serial.append(
        ("agent: near-identical asks", [chat(tok, t) for t in agent_requests(NEAR_WORDINGS)])
    )
    print(header("workload | tokens"), flush=True)
    for name, requests in serial:
        max_tokens = 64 if name.startswith("agent") else 96
        outs, seen = [], []
        for prompt in requests:
            out = greedy(model, prompt, max_tokens)
            outs.append((seen + list(prompt), out))
            seen = seen + list(prompt) + out  # later requests may copy from it (the corpus)
        cells = []
        for _, n in CONTEXTS:
            L = [lengths_for(ctx, out, n, cap, verify) for ctx, out in outs]
            ratio, tpf = simulate(L, 1, {(1, w): costs[1, w] for w in WIDTHS}, own=n == "tree")
            cells.append(f"{tpf:.2f}, {ratio:.2f}x")
        total = sum(len(o) for _, o in outs)
        print(f"| {name} | {total} | " + " | ".join(cells) + " |", flush=True)

    print("\n" + header("pool (batched server) | C"), flush=True)
    for pool_name, pool in (("grounded", grounded()), ("open", OPEN)):
        outs = []
        for text in pool:
            prompt = chat(tok, text)
            outs.append((list(prompt), greedy(model, prompt, 128)))
        by_n = {
            n: [lengths_for(ctx, out, n, cap, verify) for ctx, out in outs] for _, n in CONTEXTS
        }
        for C in levels:
            cost = {
                (B, w): costs[nearest_batch(B, batches), w] for B in range(1, C + 1) for w in WIDTHS
            }
            cells = []
            for _, n in CONTEXTS:
                ratio, tpf = simulate(by_n[n], C, cost, laps=4, own=n == "tree")
                cells.append(f"{tpf:.2f}, {ratio:.2f}x")
            print(f"| {pool_name} | {C} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
