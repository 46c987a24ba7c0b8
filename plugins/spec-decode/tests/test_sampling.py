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
from mlx_lm_spec_decode.sampling import describe

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
    # Second token: its marginal under the target, mixing over the first.
    p2 = Counter()
    for t1, q1 in p1.items():
        for t2, q2 in target_probs(model, prompt + [t1], filt, processors, 2).items():
            p2[t2] += q1 * q2
    second = Counter()
    for (_, t2), c in pairs.items():
        second[t2] += c
    stat, df = chi2(second, dict(p2), N)
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
