"""Prompt lookup first, a model drafter where nothing matches (``--draft-lookup``).

A model drafter (the assistant, a draft model) guesses every token at the
price of its draft steps; prompt lookup guesses only where the text copies
its context, and there for free and often for many tokens at once. Each is
bounded where the other is strong: on text that quotes its input, n-gram
lookup stops at what it can copy (``bench_drafting_ceiling.py``), and the
model drafter's per-token guesses miss the long copies. ``LookupFirst``
asks the lookup first and the model drafter only where the lookup proposes
nothing, so a round's drafts are a copy where one matches and the model's
guess elsewhere (as SuffixDecoding pairs a suffix index with a model
speculator).

The two guess at different rates and cost differently to ask, so each
keeps its own acceptance in the request and sizes its own drafts
(``sizes_drafts``: the loop asks for up to its longest draft): the length
whose rounds emit most per plain step's time at the loop's measured
verify cost and, for the model, its draft step (``policy.row_length``).
Where no length beats plain steps the model does not draft (the round
proposes nothing and the loop runs plain steps), except once every
``PROBE`` tokens to learn its acceptance anew: a model drafter too dear for
the device leaves the lookup drafting as if alone, instead of the loop
switching drafting off for both (nor does the loop switch it off for good
for the model's price, and while it is off it watches the lookup's
guesses, as it does a lone lookup's). Before the loop has timed them,
lookup drafts are at most ``START`` long and the model drafts one token.

Both drafters see the whole history: each keeps its own caches (the
lookup's after the target's, then the model drafter's) and its own
scratch state, and is told which round's drafts were its own, so the
model drafter's caches roll back only what it drafted. The lookup's drafts
come back as lists of ids and the model's as device arrays: the verify loop
prices a round's drafting from that (a list costs nothing to draft).
"""

import dataclasses
from typing import Any, List, Optional

from . import policy, sampling
from .drafter import DraftContext, Drafter
from .tree import trie

LOOKUP, MODEL = "lookup", "model"
START = 3  # the longest lookup draft before the loop has timed the verify
# The model's draft while its price is not known, and its probes: one token
# tells its acceptance and step, at the least a guess can cost.
MODEL_START = 1
PROBE = 32  # tokens without a model round before one drafts anyway (its acceptance)


class LookupFirst(Drafter):
    """``lookup``'s drafts where it proposes any, else ``model``'s."""

    batches = False  # a model drafter reads the target's caches or runs its own model

    def __init__(self, model: Drafter, lookup: Drafter):
        if lookup.needs_hidden:
            raise ValueError("a LookupFirst's lookup must not read hidden states")
        self.model, self.lookup = model, lookup
        self.name = f"{lookup.name}+{model.name}"
        self.max_draft = max(model.max_draft, lookup.max_draft)
        self.needs_hidden = model.needs_hidden
        # Trees where the model grows them: both sources' paths in one tree.
        self.tree = bool(getattr(model, "tree", False)) and callable(
            getattr(model, "draft_tree", None)
        )
        self.adaptive, self.auto_off = model.adaptive, model.auto_off
        # Adaptive: each source sizes its drafts by its own acceptance (the
        # loop asks for up to the longest); else the loop's fixed length.
        self.sizes_drafts = self.adaptive
        self._split = len(lookup.make_cache())

    def __repr__(self) -> str:
        return f"LookupFirst({self.model!r}, {self.lookup!r})"

    def make_cache(self) -> List[Any]:
        return self.lookup.make_cache() + self.model.make_cache()

    def cache_ok(self, caches: List[Any]) -> bool:
        n = self._split
        return self.lookup.cache_ok(caches[:n]) and self.model.cache_ok(caches[n:])

    def _ctx(self, ctx: DraftContext, which: str) -> DraftContext:
        """The context one drafter sees: its own caches and scratch state."""
        caches = ctx.cache[: self._split] if which == LOOKUP else ctx.cache[self._split :]
        return dataclasses.replace(ctx, cache=caches, state=ctx.state.setdefault(which, {}))

    def prefill(self, ctx: DraftContext, tokens: List[int]) -> None:
        self.lookup.prefill(self._ctx(ctx, LOOKUP), tokens)
        self.model.prefill(self._ctx(ctx, MODEL), tokens)

    def draft(self, ctx: DraftContext, n: int) -> "tuple[Any, Optional[Any]]":
        ctx.state["drafted"] = {}
        drafts, probs = self._lookup(ctx, n)
        g = self._length(ctx, LOOKUP, len(drafts), 0.0)
        if g:
            ctx.state["drafted"] = {LOOKUP: g}
            return drafts[:g], (probs[:g] if probs is not None else None)
        if len(drafts) and "declined" not in ctx.state:
            # A copy too unlikely to pay for its verify is still scored,
            # for free, against the tokens that follow: else a lookup
            # declined at its prior acceptance would never learn better.
            ctx.state["declined"] = (list(drafts), 0)
        g = self._model_length(ctx, n)
        if not g:
            return [], None
        drafts, probs = self.model.draft(self._ctx(ctx, MODEL), g)
        ctx.state["drafted"] = {MODEL: len(drafts)}
        ctx.state["idle"] = 0
        return drafts, probs

    def draft_tree(self, ctx: DraftContext, n: int) -> List["tuple[List[int], float]"]:
        """About ``n`` nodes of one tree holding both: the lookup's copies,
        and the model's own tree where its rounds pay (as ``draft`` decides
        for a chain). Each source's paths weigh its acceptance in all, so a
        node both propose weighs the most; the loop cuts the tree to what
        pays at the verify's measured price. The model's nodes are told in
        ``ctx.computed``: only they cost a draft step."""
        look = self._lookup_paths(ctx, n)
        g = self._model_length(ctx, n)
        # A model that pays grows a tree of the whole budget; its probe, one token.
        mine = (
            self.model.draft_tree(self._ctx(ctx, MODEL), n if g > MODEL_START else g) if g else []
        )
        ctx.state["drafted"] = {
            w: [p for p, _ in ps] for w, ps in ((LOOKUP, look), (MODEL, mine)) if ps
        }
        ctx.computed = len(trie(mine)[0]) - 1
        if mine:
            ctx.state["idle"] = 0
        return self._weighed(ctx, LOOKUP, look) + self._weighed(ctx, MODEL, mine)

    def _lookup_paths(self, ctx: DraftContext, n: int) -> List["tuple[List[int], float]"]:
        """The lookup's tree where it grows one, else its chain as one path."""
        if getattr(self.lookup, "tree", False) and callable(
            getattr(self.lookup, "draft_tree", None)
        ):
            return self.lookup.draft_tree(self._ctx(ctx, LOOKUP), min(n, self.lookup.max_draft))
        drafts = list(self._lookup(ctx, n)[0])
        return [(drafts, 1.0)] if drafts else []

    def _weighed(self, ctx, which, paths):
        """``paths`` rescaled to weigh ``which``'s acceptance in all."""
        total = sum(w for _, w in paths)
        alpha = self._acceptance(ctx, which).alpha
        return [(p, w * alpha / total) for p, w in paths] if total > 0 else []

    def _model_length(self, ctx: DraftContext, n: int) -> int:
        """The model's draft length where its rounds pay (0: they do not)."""
        return self._length(ctx, MODEL, min(n, self.model.max_draft), ctx.draft_cost)

    def guess(self, ctx: DraftContext, n: int) -> List[int]:
        """The lookup's proposal alone (free to ask): the loop scores it while
        drafting is off, and resumes drafting where it holds."""
        return list(self._lookup(ctx, n)[0])

    def _lookup(self, ctx: DraftContext, n: int) -> "tuple[Any, Optional[Any]]":
        return self.lookup.draft(self._ctx(ctx, LOOKUP), min(n, self.lookup.max_draft))

    def _length(self, ctx: DraftContext, which: str, proposed: int, draft: Any) -> int:
        """How many of ``proposed`` drafts of ``which`` to verify (0: none pay)."""
        if not proposed or not self.adaptive:
            return proposed
        probe = which == MODEL and ctx.state.get("idle", 0) >= PROBE
        if ctx.verify_cost is None or draft is None or probe:
            return min(proposed, START if which == LOOKUP else MODEL_START)
        alpha = self._acceptance(ctx, which).alpha
        return policy.row_length(alpha, proposed, ctx.verify_cost, draft)

    def _acceptance(self, ctx: DraftContext, which: str) -> policy.Acceptance:
        return ctx.state.setdefault(f"{which} acceptance", policy.Acceptance())

    def accept(self, ctx: DraftContext, tokens: List[int], n_drafted: int) -> None:
        # Each is told of its own drafts only: those the accepted path holds.
        kept = self._credit(ctx, ctx.state.pop("drafted", None) or {}, tokens[:n_drafted])
        self._score_declined(ctx, tokens)
        if MODEL not in kept:
            ctx.state["idle"] = ctx.state.get("idle", 0) + len(tokens)
        self.lookup.accept(self._ctx(ctx, LOOKUP), tokens, kept.get(LOOKUP, 0))
        self.model.accept(self._ctx(ctx, MODEL), tokens, kept.get(MODEL, 0))

    def _credit(self, ctx: DraftContext, drafted: dict, path: List[int]) -> dict:
        """Each source's acceptance told of its round: a chain of ``k``
        drafts kept as far as the accepted ``path``; a tree's paths, by the
        one that agrees with it longest. Returns the drafts each kept."""
        kept = {}
        for which, drafts in drafted.items():
            if isinstance(drafts, int):
                k, a = drafts, len(path)
            else:
                a = max(sampling.kept(p, path) for p in drafts)
                k = max(len(p) for p in drafts if sampling.kept(p, path) == a)
            if k:
                self._acceptance(ctx, which).observe(k, a)
                kept[which] = a
        return kept

    def _score_declined(self, ctx: DraftContext, tokens: List[int]) -> None:
        """The lookup's declined copy matched against the emitted ``tokens``
        (a plain step's one, a round's several): its acceptance told once
        the copy ends or a token differs."""
        if "declined" not in ctx.state:
            return
        copy, a = ctx.state.pop("declined")
        a, ended = policy.follow(copy, a, tokens)
        if not ended:
            ctx.state["declined"] = (copy, a)  # all matched so far: the copy goes on
            return
        self._acceptance(ctx, LOOKUP).observe(len(copy), a)

    def trim(self, ctx: DraftContext, n: int) -> None:
        self.lookup.trim(self._ctx(ctx, LOOKUP), n)
        self.model.trim(self._ctx(ctx, MODEL), n)

    def flush(self, ctx: DraftContext) -> None:
        self.lookup.flush(self._ctx(ctx, LOOKUP))
        self.model.flush(self._ctx(ctx, MODEL))
