"""Token trees: tree forwards equal chain forwards over each path, the cache
keeps exactly the accepted path, greedy tree decoding is token-identical to
stock on the offline model, sampled tree acceptance reproduces the target's
distribution, and caches that cannot take a tree fall back to chains."""

import argparse
import logging
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_k, make_sampler
from test_sampling import TEMP, chi2, chi2_critical, second_probs, target_probs

from mlx_lm_spec_decode import (
    Drafter,
    NGramDrafter,
    SuffixCorpus,
    SuffixDrafter,
    last_stats,
    ragged,
    sampling,
    speculative_generate_step,
)
from mlx_lm_spec_decode import plugin as plugin_mod
from mlx_lm_spec_decode import target as target_mod
from mlx_lm_spec_decode import tree as tree_mod
from mlx_lm_spec_decode.controller import Controller


@pytest.fixture
def cheap_width(monkeypatch):
    """A machine where a wider verify costs almost nothing: trees pay."""
    monkeypatch.setattr(Controller, "verify_cost", lambda self: (0.95, 0.01))
    monkeypatch.setattr(Controller, "tree_surcharge", lambda self: 0.0)


def kv(cache, n):
    return [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]


def assert_same_kv(got, ref, atol=1e-4):
    for (k1, v1), (k2, v2) in zip(got, ref, strict=True):
        assert k1.shape == k2.shape
        assert mx.allclose(k1, k2, atol=atol).item() and mx.allclose(v1, v2, atol=atol).item()


# ------------------------------------------------------------ plain data


def test_a_chain_tree_is_a_chain():
    tokens, parents, shares = tree_mod.trie([([5, 6, 7], 1.0)])
    assert tokens == [-1, 5, 6, 7] and parents == [-1, 0, 1, 2] and shares == [1.0] * 4
    assert tree_mod.is_chain(parents) and tree_mod.depths(parents) == [0, 1, 2, 3]
    causal = mx.tril(mx.ones((4, 4), mx.bool_))
    assert mx.array_equal(tree_mod.ancestors(parents), causal).item()


def test_trie_merges_shared_prefixes_and_select_follows_the_cost():
    tokens, parents, shares = tree_mod.trie([([5, 6], 1.0), ([5, 8], 1.0), ([9], 2.0)])
    assert tokens == [-1, 5, 6, 8, 9] and parents == [-1, 0, 1, 1, 0]
    assert shares == [1.0, 0.5, 0.25, 0.25, 0.5]
    assert tree_mod.depths(parents) == [0, 1, 2, 2, 1]
    assert tree_mod.path_to(parents, 3) == [0, 1, 3]
    # No measured cost: the most likely path only, as far as the limit.
    assert tree_mod.select(parents, shares, 4, None) == [0, 1, 2]
    # Nearly free width: everything; costly width: the likeliest nodes only.
    assert tree_mod.select(parents, shares, 15, (0.99, 0.01)) == [0, 1, 2, 3, 4]
    assert tree_mod.select(parents, shares, 15, (0.6, 0.4)) == [0, 1, 4]
    assert tree_mod.select(parents, shares, 15, (0.2, 0.8)) == [0]
    assert tree_mod.subtree(tokens, parents, [0, 1, 3]) == ([-1, 5, 8], [-1, 0, 1])


def test_a_tree_must_beat_the_chain_at_its_measured_price():
    tokens, parents, shares = tree_mod.trie([([5, 6], 1.0), ([5, 8], 1.0), ([9], 1.0)])
    cost = (0.95, 0.05)
    tree = tree_mod.select(parents, shares, 15, cost)
    chain = tree_mod.best_chain(parents, shares, 15, cost)
    assert not tree_mod.is_chain(tree_mod.subtree(tokens, parents, tree)[1])
    assert tree_mod.is_chain(tree_mod.subtree(tokens, parents, chain)[1]) and chain[:2] == [0, 1]
    assert tree_mod.tree_pays(shares, tree, chain, cost, 0.0)  # a tree costs a chain's price
    assert not tree_mod.tree_pays(shares, tree, chain, cost, 1.0)  # a GPU's unfused path


def test_tree_surcharge_is_timed_apart_from_chains():
    ctl = Controller(3, 16)
    for dt in (1.0, 1.0):
        ctl.update(0, 0, dt)
    for w in (4, 8):
        ctl.update(w - 1, 1, 1.0 + 0.05 * (w - 1))
    assert ctl.tree_surcharge() == 0.0  # no tree timed yet
    ctl.update(5, 2, 2.5, trials=3)  # a six-wide tree at 2.5 steps, two of three kept
    a, b = ctl.verify_cost()
    assert b == pytest.approx(0.05) and ctl.tree_surcharge() == pytest.approx(2.5 - a - 6 * b)


def test_trees_give_way_to_chains_once_they_keep_less_than_they_cost():
    """A tree the estimates favour is drafted until tree rounds have shown
    what they keep against the chain each replaced: where the target kept
    no more than the chain would have, chains, with one tree every
    ``RETRY`` rounds; where the tree's extra tokens pay its surcharge,
    trees."""
    from types import SimpleNamespace

    from mlx_lm_spec_decode.tree_verify import TreeRounds

    paths = [([5, 6, 7], 1.0), ([5, 8], 1.0), ([9, 4], 1.0)]  # 5 and 9 disagree
    drafter = SimpleNamespace(draft_tree=lambda ctx, n: paths, adaptive=True)
    ctl = SimpleNamespace(
        verify_cost=lambda: (1.0, 0.0),  # columns free: the whole tree is worth verifying
        tree_surcharge=lambda: 0.1,  # a tree's verify costs 0.1 step more than a chain's
        free_drafts=lambda: None,
    )
    loop = SimpleNamespace(drafter=drafter, ctl=ctl, ctx=SimpleNamespace(), y=1, free=False)

    def drafts_a_tree(rounds):
        drafts, _ = rounds.draft(3, 15)
        return drafts is None

    lost = TreeRounds(loop)
    for _ in range(TreeRounds.KEPT_MIN):
        assert drafts_a_tree(lost)
        lost.record([5, 6], [5, 6, 7])  # the chain alone would have kept as much
    tried = [drafts_a_tree(lost) for _ in range(2 * TreeRounds.RETRY)]
    assert sum(tried) == 1  # chains, one tree retried in between

    won = TreeRounds(loop)
    for _ in range(TreeRounds.KEPT_MIN):
        assert drafts_a_tree(won)
        won.record([9, 4], [5, 6, 7])  # the chain's first guess was wrong
    assert all(drafts_a_tree(won) for _ in range(2 * TreeRounds.RETRY))


# ------------------------------------------------------ the tree forward


@pytest.mark.parametrize("policy", ["fused", "explicit", "padded"])
def test_tree_forward_equals_chain_forwards_and_compacts_to_them(tiny_llama, policy, monkeypatch):
    model, _ = tiny_llama
    padded, real = [], target_mod.padded_attention
    monkeypatch.setattr(
        target_mod, "padded_attention", lambda *a: padded.append(real(*a)) or padded[-1]
    )
    prompt = [3, 14, 15, 92, 65]
    tokens, parents = [35, 89, 79, 32, 38, 46, 26], [-1, 0, 0, 2, 2, 3, 1]
    # Chain-shaped first: a tree forward of a chain is a chain forward.
    for toks, pars in ((tokens[:3], [-1, 0, 1]), (tokens, parents)):
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        logits = tree_mod.forward(model, cache, toks, pars, policy)
        for leaf in range(len(toks)):
            path = tree_mod.path_to(pars, leaf)
            seq = prompt + [toks[i] for i in path]
            ref = model(mx.array(seq)[None])[0, len(prompt) :]
            assert mx.allclose(logits[mx.array(path)], ref, atol=1e-4).item(), (pars, leaf)
    # The padded policy ran the fused op over the buffer, once per layer and forward.
    assert sum(o is not None for o in padded) == (
        2 * len(model.layers) if policy == "padded" else 0
    )
    # Keep the path to node 5 (not contiguous: nodes 0, 2, 3, 5).
    path = tree_mod.path_to(parents, 5)
    ragged.keep(cache, len(tokens), [path])  # one request: the plain-cache adapter
    seq = prompt + [tokens[i] for i in path]
    ref = make_prompt_cache(model)
    model(mx.array(seq)[None], cache=ref)
    assert cache[0].offset == len(seq)
    assert_same_kv(kv(cache, len(seq)), kv(ref, len(seq)))
    assert tree_mod.tree_ok(model, policy)


def test_greedy_and_sampled_acceptance_walk_the_tree():
    win = sampling.Window([0, 4, 7, 1, 2], [-1, 0, 0, 2, 2])
    # Target says 7 after the root, 2 after node 2, 9 after node 4.
    assert sampling.walk(win, ([7, 0, 2, 0, 9],), "greedy") == ([0, 2, 4], 9)
    assert sampling.walk(win, ([5, 0, 0, 0, 0],), "match") == ([0], 5)
    # Sampled: node 1 rejected (u * 1 >= p), node 2 accepted (u * rest < p).
    p_child, u, res = [0, 0.2, 0.5, 0.1, 0.1], [0, 0.5, 0.3, 0.99, 0.99], [8, 8, 6, 8, 8]
    assert sampling.walk(win, (p_child, [1.0] * 5, u, res), "explicit") == ([0, 2], 6)
    # A chain is the tree whose parents are i - 1: greedy keeps the agreeing prefix.
    chain = sampling.chain(3, [5, 6, 7])
    assert chain.parents == [-1, 0, 1, 2]
    assert sampling.walk(chain, ([5, 6, 1, 0],), "greedy") == ([0, 1, 2], 1)
    assert sampling.walk(chain, ([5, 6, 7, 8],), "greedy") == ([0, 1, 2, 3], 8)
    assert sampling.walk(chain, ([9, 6, 7, 8],), "greedy") == ([0], 9)


# ------------------------------------------------------ decoding with trees


class Branchy(NGramDrafter):
    """The n-gram drafter's paths and, every round, a wrong sibling first: the
    loop verifies a branching tree each time it drafts."""

    name = "branchy"

    def draft_tree(self, ctx, n):
        paths = super().draft_tree(ctx, n)
        if paths:
            wrong = [(paths[0][0][0] + 1) % 1000] + paths[0][0][1:]
            paths = [(wrong, 2.0)] + paths
        return paths


def stock(model, prompt, n):
    out = []
    for t, _ in generate_step(prompt, model, max_tokens=n):
        out.append(int(t))
    return out


def spec(model, drafter, prompt, n, cache):
    return [
        t
        for t, _, _ in speculative_generate_step(
            prompt, model, drafter, num_draft_tokens=3, max_tokens=n, prompt_cache=cache
        )
    ]


@pytest.mark.slow
def test_greedy_trees_token_identical_to_stock_on_the_offline_model(smollm2_f32_path, cheap_width):
    from test_parity_smollm2 import PROMPTS

    model, tok = load(str(smollm2_f32_path))
    n, trees = 40, 0
    corpus = SuffixCorpus(cap=100_000)
    for text in PROMPTS:
        prompt = mx.array(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )
        ref = stock(model, prompt, n)
        for drafter in (Branchy(), NGramDrafter(), SuffixDrafter(corpus=corpus)):
            cache = make_prompt_cache(model) + drafter.make_cache()
            out = spec(model, drafter, prompt, n, cache)
            assert out == ref, (drafter.name, text[:40], tok.decode(out), tok.decode(ref))
            trees += last_stats().tree_rounds
            # The cache holds exactly prompt + emitted, as a plain forward leaves it.
            seq = prompt.tolist() + out
            plain = make_prompt_cache(model)
            model(mx.array(seq)[None], cache=plain)
            assert cache[0].offset == len(seq)
            assert_same_kv(kv(cache[: len(model.layers)], len(seq)), kv(plain, len(seq)), 1e-3)
    assert trees > 10


class FixedTree(Drafter):
    """Always proposes the same paths, as a tree."""

    name = "fixed-tree"
    auto_off = False
    adaptive = False
    tree = True

    def __init__(self, paths):
        self.paths = paths

    def draft_tree(self, ctx, n):
        return [(p[:n], 1.0) for p in self.paths]


def test_sampled_tree_acceptance_matches_target_distribution(tiny_llama, cheap_width):
    model, tok = tiny_llama
    prompt = tok.encode("the cat sat on the")
    mx.random.seed(0)
    sampler = make_sampler(TEMP, top_k=6)
    filt = lambda lp: apply_top_k(lp, 6)  # noqa: E731
    p1 = target_probs(model, prompt, filt, None, 1)
    top = sorted(p1, key=p1.get, reverse=True)
    # Root siblings: the second, first and fourth most likely; a likely and
    # an unlikely follower under them: acceptance and rejection at each level.
    p2 = target_probs(model, prompt + [top[1]], filt, None, 2)
    f = sorted(p2, key=p2.get, reverse=True)
    drafter = FixedTree([[top[1], f[0]], [top[1], f[2]], [top[0]], [top[3], top[0]]])
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    start, N = cache[0].offset, 600
    first, second, trees = Counter(), Counter(), 0
    for _ in range(N):
        toks = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(prompt[-1:]),
                model,
                drafter,
                num_draft_tokens=2,
                max_tokens=3,
                sampler=sampler,
                prompt_cache=cache,
            )
        ]
        trees += last_stats().tree_rounds
        first[toks[0]] += 1
        second[toks[1]] += 1
        assert cache[0].offset == start + 4
        trim_prompt_cache(cache, 4)
    assert trees == N
    stat, df = chi2(first, p1, N)
    assert stat < chi2_critical(df), ("first token", stat, df)
    stat, df = chi2(second, second_probs(model, prompt, filt, None, p1), N)
    assert stat < chi2_critical(df), ("second token", stat, df)


@pytest.mark.parametrize("how", ["rotating", "quantized"])
def test_caches_that_cannot_take_a_tree_draft_chains(tiny_model, caplog, cheap_width, how):
    model, tok = load(str(tiny_model("llama", head_dim=32)))  # quantizable by groups of 32
    prompt = mx.array(tok.encode("one two three four one two three four one two three four"))
    ref = stock(model, prompt, 12)
    if how == "rotating":
        cache, kw = [RotatingKVCache(max_size=256, keep=4) for _ in model.layers], {}
    else:
        cache, kw = None, dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    drafter = Branchy(n_min=1)
    with caplog.at_level(logging.INFO, logger="mlx_lm_spec_decode"):
        out = [
            t
            for t, _, _ in speculative_generate_step(
                prompt, model, drafter, num_draft_tokens=3, max_tokens=12, prompt_cache=cache, **kw
            )
        ]
    if how == "rotating":
        assert out == ref
    else:
        kw.pop("kv_bits")
        ref = [int(t) for t, _ in generate_step(prompt, model, max_tokens=12, kv_bits=8, **kw)]
        assert out == ref
    lines = [r for r in caplog.records if "token trees need plain KV caches" in r.getMessage()]
    assert len(lines) == 1
    assert last_stats().tree_rounds == 0


def test_draft_tree_flag(tiny_llama):
    model, tok = tiny_llama
    for which in ("ngram", "suffix"):
        for flag, want in (("auto", True), ("off", False)):
            args = argparse.Namespace(
                drafter=which, draft_tree=flag, ngram_max=4, ngram_min=2, suffix_corpus_tokens="100"
            )
            plugin_mod._check(args)
            d = plugin_mod.make_drafter("generate", model, tok, None, args, args)
            assert d.tree is want
    with pytest.raises(Exception, match="--draft-tree"):
        plugin_mod._check(argparse.Namespace(draft_tree="wide"))
