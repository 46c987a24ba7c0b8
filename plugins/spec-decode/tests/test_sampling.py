"""Speculative sampling reproduces the target's own distribution.

On a tiny model, the first two emitted tokens are drawn thousands of times
through the verify loop, with drafts that are sometimes right and sometimes
wrong, and their frequencies are compared by a chi-square test with the
exact distributions computed from the target (temperature, top-k/top-p and
logits processors applied the way plain decoding applies them)."""

import math
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors, make_sampler

from mlx_lm_spec_decode import Drafter, DraftModelDrafter, speculative_generate_step
from mlx_lm_spec_decode.sampling import Rule, Window, accept, chain, describe

N = 600
TEMP = 0.8


class Fixed(Drafter):
    """Always proposes the same tokens."""

    name = "fixed"
    auto_off = False
    adaptive = False

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, ctx, n):
        return self.tokens[:n], None


def chi2_critical(df, z=3.09):  # upper 0.1% point (Wilson-Hilferty)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs, n):
    outside = sum(c for k, c in counts.items() if k not in probs)
    assert outside == 0, f"{outside} draws outside the support"
    keys = sorted(probs, key=probs.get, reverse=True)
    big = [k for k in keys if probs[k] * n >= 5]
    rest = [k for k in keys if k not in big]
    stat = sum((counts.get(k, 0) - probs[k] * n) ** 2 / (probs[k] * n) for k in big)
    other_p = sum(probs[k] for k in rest)
    other_c = sum(c for k, c in counts.items() if k not in big)
    if other_p * n >= 5:
        stat += (other_c - other_p * n) ** 2 / (other_p * n)
        return stat, len(big)
    if other_p == 0:
        return stat, len(big) - 1
    # Too rare for a bin of their own: pooled with the least likely big one.
    k = big[-1]
    stat -= (counts.get(k, 0) - probs[k] * n) ** 2 / (probs[k] * n)
    pooled_p, pooled_c = probs[k] + other_p, counts.get(k, 0) + other_c
    stat += (pooled_c - pooled_p * n) ** 2 / (pooled_p * n)
    return stat, len(big) - 1


def target_probs(model, seq, filt, processors, n_context):
    """Exact next-token distribution; processors see the last n_context tokens
    (the loop's processors see the prompt it was given plus what it emitted)."""
    logits = model(mx.array(seq)[None])[:, -1, :]
    for p in processors or []:
        logits = p(mx.array(seq[-n_context:]), logits)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    lp = filt(lp)
    p = mx.softmax(lp * (1 / TEMP), axis=-1)[0]
    pl = p.tolist()
    return {i: v for i, v in enumerate(pl) if v > 1e-9}


def second_probs(model, prompt, filt, processors, first):
    """The second emitted token's exact distribution: its marginal under the
    target, mixing over ``first`` (the first token's, ``target_probs``)."""
    p2 = Counter()
    for t1, q1 in first.items():
        for t2, q2 in target_probs(model, prompt + [t1], filt, processors, 2).items():
            p2[t2] += q1 * q2
    return dict(p2)


def run(model, drafter, prompt, sampler, processors):
    cache = make_prompt_cache(model) + drafter.make_cache()
    model(mx.array(prompt[:-1])[None], cache=cache[: len(model.layers)])
    if drafter.make_cache():
        drafter.model(mx.array(prompt[:-1])[None], cache=cache[len(model.layers) :])
    start = cache[0].offset
    first, second = Counter(), Counter()
    for _ in range(N):
        # The cache is exact after close, so trimming it back restores the prompt.
        toks = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(prompt[-1:]),
                model,
                drafter,
                num_draft_tokens=2,
                max_tokens=2,
                sampler=sampler,
                logits_processors=processors,
                prompt_cache=cache,
            )
        ]
        first[toks[0]] += 1
        second[tuple(toks)] += 1
        assert cache[0].offset == start + 3  # the last prompt token and the two emitted
        trim_prompt_cache(cache, 3)
    return first, second


CASES = {
    "top-k, deterministic drafts, logits processors": dict(top_k=6, processors=True),
    "top-p and top-k, draft model q": dict(top_p=0.95, top_k=8, draft=True),
    "opaque sampler (sample-and-match)": dict(top_k=6, opaque=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(tiny_llama, tiny_draft, case):
    model, tok = tiny_llama
    cfg = CASES[case]
    prompt = tok.encode("the cat sat on the")
    mx.random.seed(0)
    sampler = make_sampler(TEMP, top_p=cfg.get("top_p", 0.0), top_k=cfg.get("top_k", 0))

    def filt(lp):  # the reference: mlx-lm's order, top-p before top-k
        if "top_p" in cfg:
            lp = apply_top_p(lp, cfg["top_p"])
        return apply_top_k(lp, cfg["top_k"])

    processors = None
    if cfg.get("processors"):
        # Bias the third most likely token up, and penalize repeats: the
        # second position's penalty depends on the first emitted token.
        top = sorted(target_probs(model, prompt, filt, None, 1).items(), key=lambda kv: -kv[1])
        processors = make_logits_processors(logit_bias={top[2][0]: 0.7}, repetition_penalty=3.0)
    if cfg.get("opaque"):
        inner = sampler
        sampler = lambda lp: inner(lp)  # noqa: E731  not introspectable
        assert describe(sampler)[0] == "match"
    else:
        assert describe(sampler)[0] == "explicit"

    p1 = target_probs(model, prompt, filt, processors, 1)
    top = sorted(p1, key=p1.get, reverse=True)
    # Draft the second most likely token, then a likely follower of it: both
    # acceptance and rejection happen often.
    d1 = top[1]
    d2 = max(target_probs(model, prompt + [d1], filt, processors, 2).items(), key=lambda kv: kv[1])[
        0
    ]
    drafter = DraftModelDrafter(tiny_draft, auto_off=False) if cfg.get("draft") else Fixed([d1, d2])

    first, pairs = run(model, drafter, prompt, sampler, processors)
    stat, df = chi2(first, p1, N)
    assert stat < chi2_critical(df), (case, "first token", stat, df)
    second = Counter()
    for (_, t2), c in pairs.items():
        second[t2] += c
    stat, df = chi2(second, second_probs(model, prompt, filt, processors, p1), N)
    assert stat < chi2_critical(df), (case, "second token", stat, df)


def test_chi2_detects_a_biased_sampler(tiny_llama):
    """The test above can fail: accepting every draft skews the distribution."""
    model, tok = tiny_llama
    prompt = tok.encode("the cat sat on the")
    filt = lambda lp: apply_top_k(lp, 6)  # noqa: E731
    p1 = target_probs(model, prompt, filt, None, 1)
    d1 = sorted(p1, key=p1.get, reverse=True)[1]
    biased = Counter({d1: N})
    stat, df = chi2(biased, p1, N)
    assert stat > chi2_critical(df)


def test_one_logprobs_function_for_chains_and_trees():
    """A chain is a tree whose parents are i - 1: both forms give the rows a
    plain step would (its processors seeing the context and the window up to
    that position), and a branch sees its own path only."""
    from mlx_lm_spec_decode.sampling import kept, window_logprobs

    mx.random.seed(3)
    logits = mx.random.normal((4, 32))
    procs = make_logits_processors(repetition_penalty=1.7)
    ctx, win = [4, 5], [7, 3, 9, 5]

    def step(seen, i):
        row = logits[i : i + 1]
        for p in procs:
            row = p(mx.array(seen, mx.uint32), row)
        return (row - mx.logsumexp(row, axis=-1, keepdims=True))[0]

    chain = window_logprobs(logits, procs, ctx, win)
    tree = window_logprobs(logits, procs, mx.array(ctx), win, [-1, 0, 1, 2])
    branch = window_logprobs(logits, procs, ctx, win, [-1, 0, 0, 2])  # node 3 under node 2
    for i in range(4):
        assert mx.allclose(chain[i], step(ctx + win[: i + 1], i)).item()
        assert mx.allclose(tree[i], chain[i]).item()
    assert mx.allclose(branch[2], step(ctx + [7, 9], 2)).item()
    assert mx.allclose(branch[3], step(ctx + [7, 9, 5], 3)).item()
    assert not mx.allclose(branch[2], chain[2]).item()  # 3 is not on node 2's path
    plain = window_logprobs(logits, None, ctx, win)
    assert mx.allclose(plain, logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()
    assert [kept([1, 2, 3], t) for t in ([1, 2, 3, 4], [1, 9, 3, 4], [1, 2])] == [3, 1, 2]


# ------------------------------------------- the one acceptance function


def _emit(win, lp, rule):
    """The tokens a round over ``win`` emits: the accepted path's, then the next."""
    path, tok = accept(win, lp, rule)
    tokens = win.tokens.tolist() if isinstance(win.tokens, mx.array) else win.tokens
    return [tokens[i] for i in path[1:]] + [tok]


def _tv(counts, probs, n):
    keys = set(counts) | set(range(len(probs)))
    return 0.5 * sum(abs(counts.get(k, 0) / n - (probs[k] if k < len(probs) else 0)) for k in keys)


def test_greedy_acceptance_on_chains_and_trees():
    """Greedy keeps the longest path the target's argmax agrees with."""
    V = 6
    best = [3, 1, 4, 2, 5]  # the target's argmax after each node
    lp = mx.log(mx.softmax(mx.eye(V)[mx.array(best)] * 4.0, axis=-1))
    rule = Rule(None)
    assert accept(chain(0, [3, 1, 0, 5]), lp, rule) == ([0, 1, 2], 4)
    assert accept(chain(0, mx.array([3, 2, 0, 5])), lp, rule) == ([0, 1], 1)
    # Root children 2 (node 1) and 3 (node 2); node 2's children 0 and 4.
    tree = Window([0, 2, 3, 0, 4], [-1, 0, 0, 2, 2])
    assert accept(tree, lp, rule) == ([0, 2, 4], 5)


TRIALS = 3000


@pytest.mark.parametrize("form", ["tree, deterministic siblings", "chain, sampled with q"])
def test_speculative_sampling_emits_the_targets_distribution(form):
    """Over many rounds on a five-token vocabulary, the first and second
    emitted tokens follow the target's own distributions (total variation
    within sampling noise), with drafts that are often rejected: the
    residual step after a rejection carries what the drafts took away."""
    V = 5
    mx.random.seed(11)
    p = mx.softmax(mx.random.normal((6, V)) * 1.5, axis=-1)
    lp = mx.log(p)
    rule = Rule(make_sampler(1.0))
    assert rule.kind == "explicit"
    first, second = Counter(), {t: Counter() for t in range(V)}
    if form.startswith("tree"):
        # Root children: the two likeliest tokens; node 1 has one child, node 2 two.
        order = mx.argsort(-p[0]).tolist()
        tokens, parents = [4, order[0], order[1], 2, 0, 3], [-1, 0, 0, 1, 2, 2]
        win = Window(tokens, parents)
        cond = {tokens[1]: 1, tokens[2]: 2}  # the node whose row the second token follows
        for _ in range(TRIALS):
            out = _emit(win, lp, rule)
            first[out[0]] += 1
            if out[0] in cond and len(out) > 1:
                second[out[0]][out[1]] += 1
    else:
        q = mx.softmax(mx.random.normal((1, V)) * 1.5, axis=-1)
        draws_q = mx.random.categorical(mx.log(q[0]), shape=(TRIALS,)).tolist()
        cond = {t: 1 + t for t in range(V)}  # row 1 + t: the target after token t
        for x in draws_q:
            out = _emit(chain(4, [x], q), mx.stack([lp[0], lp[1 + x]]), rule)
            first[out[0]] += 1
            if len(out) > 1:
                second[out[0]][out[1]] += 1
    pl = p.tolist()
    assert _tv(first, pl[0], TRIALS) < 0.04, first
    checked = 0
    for t, row in cond.items():
        n = sum(second[t].values())
        if n >= 300:
            assert _tv(second[t], pl[row], n) < 0.1, (t, second[t])
            checked += 1
    assert checked


def test_total_variation_detects_a_skipped_residual():
    """The bound above can fail: drawing a rejected round's token from the
    target itself (not the residual) over-emits the drafted tokens."""
    V = 5
    mx.random.seed(11)
    p = mx.softmax(mx.random.normal((6, V)) * 1.5, axis=-1).tolist()
    order = sorted(range(V), key=lambda t: -p[0][t])
    # Children a, b tried in turn; all rejected with 1 - p(a) - p(b), then drawn from p.
    skewed = [(1 - p[0][order[0]] - p[0][order[1]]) * x for x in p[0]]
    skewed[order[0]] += p[0][order[0]]
    skewed[order[1]] += p[0][order[1]]
    counts = Counter({t: round(c * TRIALS) for t, c in enumerate(skewed)})
    assert _tv(counts, p[0], TRIALS) > 0.04
