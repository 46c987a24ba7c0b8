"""Token trees in the batched server (``batch_tree``): a batched tree forward
equals chain forwards over each row's paths, greedy rows whose accepted
path runs through a second branch stay token-identical to the stock batched
server with equal caches, and sampled rows still follow the target."""

import threading
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import apply_top_k, make_logits_processors, make_sampler
from test_batch import assert_same, closed_stats, drive, greedy_case, llama  # noqa: F401
from test_sampling import TEMP, chi2, chi2_critical, second_probs, target_probs

from mlx_lm_spec_decode import NGramDrafter, batch_tree
from mlx_lm_spec_decode import tree as tree_mod
from mlx_lm_spec_decode.batch import SpecBatchGenerator


class Oracle(NGramDrafter):
    """Knows each request's stock output; drafts a wrong continuation
    (weighted higher, so it is the chain) with the right one beside it."""

    def __init__(self, truths, vocab):
        super().__init__(n_min=1, auto_off=False)
        self.truths, self.vocab = truths, vocab

    def _right(self, ctx, n):
        h = ctx.cache[0].tokens
        for t in self.truths:
            if t[: len(h)] == h:
                return t[len(h) : len(h) + n]
        return []

    def draft(self, ctx, n):
        return self._right(ctx, n), None

    def draft_tree(self, ctx, n):
        right = self._right(ctx, n)
        if not right:
            return []
        wrong = [(right[0] + 1) % self.vocab] + right[1:]
        return [(wrong, 2.0), (right, 1.0)]


def test_batched_tree_forward_equals_chain_forwards(llama, monkeypatch):  # noqa: F811
    model, _ = llama
    assert batch_tree._check(model)  # two rows, one left-padded, against chain forwards
    # The check sees both halves of a tree forward: positions by depth ...
    with monkeypatch.context() as m:
        m.setattr(tree_mod, "depths", lambda parents: list(range(len(parents))))
        assert not batch_tree._check(model)
    # ... and attention to ancestors only.
    with monkeypatch.context() as m:
        m.setattr(tree_mod, "ancestors", lambda parents: mx.tril(mx.ones((6, 6), mx.bool_)))
        assert not batch_tree._check(model)


@pytest.mark.parametrize("policy", ["fused", "explicit", "padded", "buffer"])
def test_greedy_tree_rows_match_stock_tokens_and_caches(llama, policy, monkeypatch):  # noqa: F811
    """``explicit``: the window's attention as matmuls; ``padded`` and
    ``buffer``: over the caches' whole buffers, as on a CUDA GPU (the tree's
    mask and positions go through each)."""
    monkeypatch.setenv("MLX_LM_SPEC_ATTENTION", policy)
    model, tok = llama
    prompts, late, kw, stock = greedy_case(model, tok)
    truths = [list(p) + t for p, (t, *_) in zip(prompts + [late[1]], stock, strict=True)]
    gen = SpecBatchGenerator(model, Oracle(truths, model.args.vocab_size), 4, 10)
    rows = closed_stats(gen)
    ours = drive(gen, prompts, [40, 25, 60], late, **kw)
    assert_same(stock, ours)
    # Trees were verified, and their right branch (never the chain) was kept:
    # the cache gathered it to the front of each row's window.
    assert all(s.tree_rounds > 0 for s in rows)
    assert sum(s.accepted for s in rows) >= sum(s.tree_rounds for s in rows)


class Pair(NGramDrafter):
    """Two continuations of the first sampled token: ``[a, e]`` and ``[b]``."""

    def __init__(self, a, e, b):
        super().__init__(n_min=1, auto_off=False, adaptive=False)
        self.paths = [([a, e], 1.0), ([b], 1.0)]

    def draft(self, ctx, n):
        return self.paths[0][0][:n], None

    def draft_tree(self, ctx, n):
        return self.paths


N = 400


def test_sampled_tree_rows_match_the_target_distribution(llama):  # noqa: F811
    """Two sampled rows, each verifying a two-branch tree: the token the tree
    decides (each row's second) follows the target's distribution."""
    model, tok = llama
    prompt = tok.encode("the cat sat on the")
    filt = lambda lp: apply_top_k(lp, 6)  # noqa: E731
    procs = make_logits_processors(repetition_penalty=2.0)
    p1 = target_probs(model, prompt, filt, None, 1)
    first = max(p1, key=p1.get)
    p2 = target_probs(model, prompt + [first], filt, None, 2)
    ranked = sorted(p2, key=p2.get, reverse=True)
    drafter = Pair(ranked[0], ranked[0], ranked[1])
    mx.random.seed(0)
    sampler = make_sampler(TEMP, top_k=6)
    seconds, trees = [Counter(), Counter()], 0
    for _ in range(N):
        gen = SpecBatchGenerator(model, drafter, 2, 2)
        rows = closed_stats(gen)
        res = drive(gen, [prompt, prompt], [4, 4], samplers=[sampler, sampler],
                    logits_processors=[None, procs])  # fmt: skip
        trees += sum(s.tree_rounds for s in rows)
        for row, (toks, *_rest) in enumerate(res):
            seconds[row][toks[1]] += 1
    assert trees >= 2 * N  # every row's first round verified its tree
    for row, processors in enumerate([None, procs]):
        p1 = target_probs(model, prompt, filt, processors, 1)
        stat, df = chi2(seconds[row], second_probs(model, prompt, filt, processors, p1), N)
        assert stat < chi2_critical(df), (row, stat, df)


def test_the_tree_check_runs_where_the_server_builds_its_generator(tiny_model):
    """mlx_lm.server builds its generator in its own thread, on its own
    stream: the model's check runs there when the generator is built, and
    finds what it finds on the main thread."""
    model, _ = load(str(tiny_model("llama")))  # a model no check has seen
    built = {}

    def build():
        stream = mx.default_stream(mx.default_device())  # as the server's thread takes it
        built["gen"] = SpecBatchGenerator(model, NGramDrafter(tree=True), 3, 8, stream=stream)

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert built["gen"].spec.trees is True
    assert SpecBatchGenerator(model, NGramDrafter(tree=False), 3, 8).spec.trees is False
