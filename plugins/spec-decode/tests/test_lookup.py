"""``LookupFirst`` (``--draft-lookup``): the prompt lookup's copy where the
text matches, a model drafter's guess elsewhere; exact output and caches."""

import argparse
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_loop import assert_exact, spec, stock

from mlx_lm_ext.api import PluginError
from mlx_lm_spec_decode import (
    Drafter,
    DraftModelDrafter,
    LookupFirst,
    NGramDrafter,
    last_stats,
    lookup,
)
from mlx_lm_spec_decode import plugin as plugin_mod
from mlx_lm_spec_decode.drafter import DraftContext
from mlx_lm_spec_decode.loop import n_target_caches


class Counted:
    """A drafter's proposals counted: rounds it proposed in."""

    def __init__(self, base, limit=None, after=0):
        self.base, self.limit, self.after, self.proposed = base, limit, after, 0

    def __getattr__(self, name):
        return getattr(self.base, name)

    def draft(self, ctx, n):
        self.after -= 1
        if self.after >= 0 or (self.limit is not None and self.proposed >= self.limit):
            return [], None
        drafts, probs = self.base.draft(ctx, n)
        self.proposed += len(drafts) > 0
        return drafts, probs


def test_a_round_drafts_the_copy_where_the_text_matches_else_the_models_guess(tiny_llama):
    model, tok = tiny_llama
    drafter = LookupFirst(DraftModelDrafter(model), NGramDrafter(n_min=2))
    ctx = DraftContext(model, make_prompt_cache(model), drafter.make_cache())
    drafter.prefill(ctx, [5, 6, 7, 8, 9, 5, 6])
    copy, _ = drafter.draft(ctx, 3)
    assert list(copy) == [7, 8]  # what followed "5 6" before: a list, free to draft
    drafter.accept(ctx, [7, 8, 11], 2)
    guess, _ = drafter.draft(ctx, 3)  # "8 11" never occurred: the draft model's step
    assert isinstance(guess, mx.array) and guess.size == 1  # one, while unpriced
    drafter.accept(ctx, [12], 0)
    drafter.flush(ctx)
    # Each drafter's caches hold the whole history, the model's drafts rolled back.
    history = [5, 6, 7, 8, 9, 5, 6, 7, 8, 11, 12]
    assert ctx.cache[0].tokens == history
    assert_exact(model, ctx.cache[1:], history)


def test_the_model_drafts_only_while_its_rounds_pay(tiny_llama):
    """Where the lookup has nothing: the model's drafts while its measured
    acceptance pays for its draft steps and the verify, none once it does
    not (plain steps, the lookup still asked), and one round again after
    ``PROBE`` tokens, to learn its acceptance anew."""
    model, tok = tiny_llama
    drafter = LookupFirst(DraftModelDrafter(model), NGramDrafter(n_min=2))
    ctx = DraftContext(model, make_prompt_cache(model), drafter.make_cache())
    drafter.prefill(ctx, list(range(100, 110)))  # nothing repeats
    ctx.verify_cost, ctx.draft_cost = (1.0, 0.0), 0.4  # a free window, dear drafts
    token = iter(range(200, 400))
    assert drafter.draft(ctx, 3)[0].size == 1  # one draft pays at the prior acceptance (1/2)
    drafter.accept(ctx, [next(token)], 0)  # every draft rejected
    assert len(drafter.draft(ctx, 3)[0]) == 0  # no longer pays
    for _ in range(lookup.PROBE - 1):
        drafter.accept(ctx, [next(token)], 0)  # plain steps
        assert len(drafter.draft(ctx, 3)[0]) == 0
    drafter.accept(ctx, [next(token)], 0)
    assert drafter.draft(ctx, 3)[0].size == 1  # the probe: one draft
    drafter.accept(ctx, [next(token), next(token)], 1)
    ctx.draft_cost = 0.05  # and at the price of a cheap drafter, all kept: it pays
    for _ in range(3):
        drafts, _ = drafter.draft(ctx, 3)
        assert drafts.size > 0
        drafter.accept(ctx, [next(token) for _ in range(drafts.size + 1)], drafts.size)
    assert drafter.draft(ctx, 3)[0].size == 3


class Paths(Drafter):
    """A model drafter growing a fixed tree (``draft_tree``); told what it kept."""

    name, tree = "paths", True

    def __init__(self, paths):
        self.paths, self.told = paths, []

    def draft_tree(self, ctx, n):
        return [(p, 1.0) for p in self.paths]

    def accept(self, ctx, tokens, n_drafted):
        self.told.append(n_drafted)


def test_a_declined_copy_is_scored_for_free_until_it_pays(tiny_llama):
    """Where a verify costs so much that the lookup's prior acceptance does
    not pay, its copies are declined but scored against the tokens that
    follow (no forward): once they hold, the lookup drafts them."""
    model, tok = tiny_llama
    drafter = LookupFirst(DraftModelDrafter(model), NGramDrafter(n_min=2))
    ctx = DraftContext(model, make_prompt_cache(model), drafter.make_cache())
    cycle = [5, 6, 7, 8, 9, 10, 11, 12]
    drafter.prefill(ctx, cycle + cycle[:2])
    ctx.verify_cost, ctx.draft_cost = (2.0, 0.01), 5.0  # a dear verify, a dearer model
    text = iter((cycle * 8)[2:])
    declined = 0
    while not len(drafts := drafter.draft(ctx, 4)[0]):
        declined += 1
        drafter.accept(ctx, [next(text)], 0)  # a plain step: the copy's next token
        assert declined < 12, "the lookup never learned that its copies hold"
    assert declined >= 1 and isinstance(drafts, list)


def test_a_tree_round_holds_both_and_credits_each_with_what_it_kept():
    """Where the model grows trees, one round's tree holds the lookup's copy
    and the model's branches, each source weighing its acceptance; the
    model's nodes are told as computed; after the verify each source is
    credited with what the accepted path kept of its own paths."""
    model = Paths([[7, 9], [4]])
    drafter = LookupFirst(model, NGramDrafter(n_min=2))
    assert drafter.tree
    ctx = DraftContext(None, None, drafter.make_cache())
    ctx.verify_cost, ctx.draft_cost = (1.0, 0.0), 0.01  # free columns, cheap drafts
    drafter.prefill(ctx, [5, 6, 7, 8, 9, 5, 6])
    paths = drafter.draft_tree(ctx, 4)
    assert paths == [([7, 8, 9, 5], 0.5), ([7, 9], 0.25), ([4], 0.25)]  # priors of 1/2 each
    assert ctx.computed == 3  # the model's nodes: 7, 9 and 4
    drafter.accept(ctx, [7, 9, 5], 2)  # the path 7 9 held: the model's
    assert model.told == [2]
    copy, theirs = drafter.draft_tree(ctx, 4), model.paths
    lookup_w = sum(w for p, w in copy if p not in theirs)
    model_w = sum(w for p, w in copy if p in theirs)
    assert lookup_w > 0 and model_w > lookup_w  # the model held two, the lookup one
    assert ctx.cache[0].tokens == [5, 6, 7, 8, 9, 5, 6, 7, 9, 5]


def test_greedy_output_and_caches_equal_stocks(tiny_llama, tiny_draft, repetitive_prompt):
    """Both drafters propose in one request (the lookup only in its first
    rounds), the output is stock's, and every cache holds exactly prompt
    plus output."""
    model, tok = tiny_llama
    prompt = mx.array(repetitive_prompt(tok).tolist() + tok.encode(" an unrelated end"))
    lookup = Counted(NGramDrafter(n_min=1), limit=3)
    drafted = Counted(DraftModelDrafter(tiny_draft, auto_off=False))
    drafter = LookupFirst(drafted, lookup)
    cache = make_prompt_cache(model) + drafter.make_cache()
    out = spec(model, drafter, prompt, 40, cache=cache)
    assert out == stock(model, prompt, 40)
    assert lookup.proposed == 3 and drafted.proposed > 0, (lookup.proposed, drafted.proposed)
    s = last_stats()
    assert s.drafter == "ngram+draft-model" and s.drafted > 0
    seq = prompt.tolist() + out
    n_t = n_target_caches(model)
    assert_exact(model, cache[:n_t], seq)
    assert cache[n_t].tokens == seq  # the lookup's index
    assert_exact(tiny_draft, cache[n_t + 1 :], seq)  # the draft model's


def test_a_lookup_round_is_priced_as_its_verify_alone():
    """A drafter that looks some drafts up (free) and computes others (a
    model's steps): the model's steps are timed once it computes, though
    lookups came first, and a lookup round's seconds are all its verify's,
    where a model round's are its verify's and its draft steps'."""
    from mlx_lm_spec_decode.controller import Controller

    verify = {}
    for free in (True, False):
        ctl = Controller(3, 10)
        ctl.free_drafts()  # a lookup round first
        assert not ctl.time_draft()
        ctl.computed_drafts()  # then the model's: its steps are timed
        assert ctl.time_draft()
        ctl.drafted(3, 0.3)  # 0.1 s a draft step
        for _ in range(2):
            ctl.update(0, 0, 1.0)  # plain steps of 1 s
        for _ in range(4):
            ctl.update(3, 3, 1.5, free=free)  # rounds of 1.5 s over 4 tokens
        a, b = ctl.verify_cost()
        verify[free] = a + 4 * b  # a 4-token verify, in plain steps
    assert verify[True] == pytest.approx(1.5) and verify[False] == pytest.approx(1.2)


def test_a_model_dearer_than_the_target_leaves_the_lookup_drafting(tiny_llama, repetitive_prompt):
    """The model's drafts are right but each step costs more than a target
    step: it stops drafting after its first rounds, drafting is never off
    for good, and the lookup drafts on."""
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 60)

    class Dear(Drafter):
        name = "dear"
        rounds = 0

        def draft(self, ctx, n):
            Dear.rounds += 1
            time.sleep(0.05 * n)
            pos = ctx.state.get("pos", 0)
            return mx.array(ref[pos : pos + n], mx.uint32), None

        def accept(self, ctx, tokens, n_drafted):
            ctx.state["pos"] = ctx.state.get("pos", 0) + len(tokens)

    lookup = Counted(NGramDrafter(n_min=1), after=4)  # silent for its first asks
    assert spec(model, LookupFirst(Dear(), lookup), prompt, 60) == ref
    s = last_stats()
    assert not s.off_for_good and lookup.proposed >= 5, (s.off_why, lookup.proposed)
    assert 1 <= Dear.rounds <= 4, Dear.rounds


def test_where_the_model_declines_plain_steps_run_pipelined(
    tiny_llama, repetitive_prompt, monkeypatch
):
    """Where the lookup has nothing and the model's rounds do not pay, the
    loop runs pipelined plain steps (runs of up to 8, ended by a lookup
    proposal), not one step per drafting decision."""
    from mlx_lm_spec_decode.controller import Controller

    # Prices pinned as a CPU measures them: the count of decisions must
    # not follow the timings of a loaded machine.
    monkeypatch.setattr(Controller, "verify_cost", lambda self: (1.3, 0.05))
    monkeypatch.setattr(Controller, "draft_cost", lambda self: 0.05)
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 80)

    class Wrong(Drafter):  # reads hidden states (as the assistant), cheap, never right
        name = "wrong"
        needs_hidden = True

        def draft(self, ctx, n):
            return mx.array([0] * n, mx.uint32), None

    class Asked(LookupFirst):
        asked = 0

        def draft(self, ctx, n):
            Asked.asked += 1
            return super().draft(ctx, n)

    never = Counted(NGramDrafter(n_min=1), after=10**6)  # the lookup never proposes
    assert spec(model, Asked(Wrong(), never), prompt, 80) == ref
    assert Asked.asked <= 25, Asked.asked  # about one decision per run, not per token


def test_a_pair_whose_verify_is_dear_still_drafts_the_copies(
    tiny_llama, repetitive_prompt, monkeypatch
):
    """The loop's measured verify cost too high for the lookup's prior
    acceptance: the copies are learned from the emitted text and drafted,
    with stock's output."""
    from mlx_lm_spec_decode.controller import Controller

    monkeypatch.setattr(Controller, "verify_cost", lambda self: (2.0, 0.01))
    monkeypatch.setattr(Controller, "draft_cost", lambda self: 5.0)
    model, tok = tiny_llama
    prompt = repetitive_prompt(tok)
    ref = stock(model, prompt, 60)
    pair = LookupFirst(DraftModelDrafter(model), NGramDrafter(n_min=1))
    assert spec(model, pair, prompt, 60) == ref
    assert last_stats().drafted > 0


def _args(**kw):
    base = dict(drafter=None, draft_model=None, draft_lookup=True, ngram_min=2, ngram_max=4)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("drafter", [None, "ngram", "suffix"])
def test_draft_lookup_needs_a_model_drafter(drafter):
    with pytest.raises(PluginError, match="--draft-lookup adds prompt lookup to a model drafter"):
        plugin_mod.activate("generate", _args(drafter=drafter))


def test_draft_lookup_wraps_the_draft_model(tiny_llama, tiny_draft):
    model, tok = tiny_llama
    args = _args(drafter="draft-model", draft_model="unused")
    plugin_mod.activate("generate", args)
    drafter = plugin_mod.make_drafter("generate", model, tok, tiny_draft, args, args)
    assert isinstance(drafter, LookupFirst) and drafter.name == "ngram+draft-model"
    assert isinstance(drafter.model, DraftModelDrafter) and not drafter.batches
    assert plugin_mod.status_options(args)["drafter"] == "ngram+draft-model"
