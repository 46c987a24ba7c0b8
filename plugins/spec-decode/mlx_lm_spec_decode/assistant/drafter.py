"""``AssistantDrafter``: the verify loop's drafter over an ``Assistant`` net.

It keeps nothing between rounds: all its context is the target's cache
(read through the donor layers) and the target's final hidden state, which
the loop hands it in ``ctx.hidden``. So its prompt caches are an empty list,
and a restored prompt cache needs nothing of it.
"""

import math
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .. import target as target_mod
from ..drafter import DraftContext, Drafter
from .config import AssistantConfig, AssistantError
from .donors import NO_HIDDEN, donor_layout, donor_view, embedding, rope_of, vocab_size
from .net import Assistant


class AssistantDrafter(Drafter):
    """Drafts with an ``Assistant`` that reads the target's cache and hidden state."""

    name = "assistant"
    needs_hidden = True
    TREE_WIDTH = 4  # nodes kept per level of a token tree (about half its drafts hold)

    def __init__(
        self,
        model: nn.Module,
        net: Assistant,
        cfg: AssistantConfig,
        *,
        split: Optional[tuple] = None,
        max_draft: int = 6,
        adaptive: bool = True,
        auto_off: bool = True,
        tree: bool = False,
    ):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        split = split or target_mod.split(model)
        if split is None:
            raise AssistantError(NO_HIDDEN)
        n = len(make_prompt_cache(model))
        if any(not (0 <= d < n) for d in cfg.donors):
            raise AssistantError(
                f"donor layers {cfg.donors} do not exist in a target with {n} caches"
            )
        self.model = model
        self.cfg = cfg
        self.head = split[1]
        self.embed = embedding(model)
        self.ropes = [rope_of(model, d) for d in cfg.donors]
        # The net computes in the donors' K/V dtype, so the attention over
        # the borrowed cache needs no cast of it.
        dtype = donor_layout(model, cfg.donors)[3]
        net.set_dtype(dtype)
        net.freeze()
        self.net = net
        self.max_draft = max_draft
        self.adaptive, self.auto_off, self.tree = adaptive, auto_off, tree
        self.vocab = vocab_size(model)

    def __repr__(self) -> str:
        layers, donors = self.cfg.num_layers, self.cfg.donors
        return f"AssistantDrafter({layers} layers, donors={donors}, max_draft={self.max_draft})"

    def make_cache(self) -> list[Any]:
        return []

    def cache_ok(self, caches: list[Any]) -> bool:
        return len(caches) == 0

    def donors(self, ctx: DraftContext) -> list[Any]:
        """The donor caches (the target's own objects) each layer reads."""
        return [ctx.target_cache[d] for d in self.cfg.donors]

    def prefill(self, ctx: DraftContext, tokens: list[int]) -> None:
        ctx.state["last"] = list(tokens[-1:])
        ctx.state["own"] = 0

    def _start(self, ctx: DraftContext, last: list[int]) -> tuple:
        """What a draft grows from: the donors' K/V (views), the pending
        token's position, no own K/V yet per layer, the target's hidden
        state and the pending token."""
        caches = self.donors(ctx)
        views = [donor_view(c) for c in caches]
        own: list = [[] for _ in self.net.layers]
        return (
            views,
            caches[-1].offset,
            own,
            ctx.hidden.reshape(1, 1, -1),
            mx.array(last, mx.uint32),
        )

    def draft(self, ctx: DraftContext, n: int) -> tuple[Any, Optional[mx.array]]:
        last = ctx.state.get("last")
        if n <= 0 or not last or ctx.hidden is None:
            return [], None
        ahead = ctx.state.pop("ahead", None)
        if ahead is not None and ahead[2]:
            # Fewer than asked where γ grew since: more would be a new chain.
            return ahead[0][:n], None
        return self._chain(ctx, *self._start(ctx, last), n)

    def draft_after(
        self,
        ctx: DraftContext,
        kept: mx.array,
        token: mx.array,
        hidden: mx.array,
        pos: mx.array,
        n: int,
    ) -> Optional[mx.array]:
        """Greedy drafts for the round after a verify the loop has queued
        but not read, all lazy: ``kept`` drafts of it held, then the
        target's token (``token``, ``[1]``) from the hidden state
        ``hidden`` (``[1, D]``), at position ``pos`` (the cache's length
        once the verify's rejected entries are cut). The donors are read
        as the verify leaves them, their entries from ``pos`` on masked,
        so the device runs these steps behind the verify while the host
        reads it. The next ``draft`` proposes them if ``accept`` is told
        of exactly that round. None where the donors' entries are not in
        position order (rotating or quantized caches)."""
        caches = self.donors(ctx)
        if n <= 0 or any(type(c) is not KVCache for c in caches):
            return None
        views = [donor_view(c) for c in caches]
        # one mask per donor for every step: its entries before ``pos``
        masks = [(mx.arange(keys.shape[-2]) < pos)[None] for keys, _, _ in views]
        own: list = [[] for _ in self.net.layers]
        start = (views, pos, own, hidden.reshape(1, 1, -1), token.astype(mx.uint32))
        drafts = self._chain(ctx, *start, n, masks=masks)[0]
        ctx.state["ahead"] = (drafts, kept, False)
        return drafts

    def _chain(self, ctx, views, pos, own, hidden, tok, n, masks=None):
        """``n`` drafts from ``_start``'s state (lazy), and their
        distributions when sampled; ``masks``: the donor entries each
        layer attends (``draft_after``)."""
        tokens, probs = [], []
        for s in range(n):
            hidden = self.net.step(
                hidden, self.embed(tok)[None], views, self.ropes, own, pos + s, masks
            )
            logits = self.head(hidden)[0, -1:, : self.vocab]
            if ctx.temp == 0:
                tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                if ctx.filter is not None:
                    lp = ctx.filter(lp)
                lp = lp.astype(mx.float32) * (1.0 / ctx.temp)
                tok = mx.random.categorical(lp).astype(mx.uint32)
                probs.append(mx.softmax(lp, axis=-1))
            tokens.append(tok)
        # The chain's own K/V entries (``own``) die here: every token the
        # target keeps will be in its own cache after the verify.
        ctx.state["own"] = n
        return mx.concatenate(tokens), (mx.concatenate(probs) if probs else None)

    def draft_tree(self, ctx: DraftContext, n: int) -> list[tuple[list[int], float]]:
        """About ``n`` nodes of a token tree, as weighted paths (``tree.trie``).

        Level by level from the pending token, as EAGLE-2 grows its trees:
        each of the last level's nodes scores its children, and the
        ``TREE_WIDTH`` children most likely under the drafter (the product of
        its probabilities down the path) form the next level; the levels'
        branches run as rows of one batch. Nothing is read back until the
        tree is grown (one wait, not one per level). The paths are weighted
        so that a node's share in the trie is its parent's share times its
        part of the probability of the kept siblings: how the drafter ranks
        the branches, which the loop scales by the request's measured
        continuation rate, as it does counted n-gram matches (a small
        drafter's raw probabilities are far from its acceptance). A short
        budget grows a chain."""
        last = ctx.state.get("last")
        if n <= 0 or not last or ctx.hidden is None:
            return []
        width = self.TREE_WIDTH if n >= 2 * self.TREE_WIDTH else 1
        depth = min(self.max_draft, n // width)
        levels = self._grow(ctx, last, depth, width)
        mx.eval(levels)
        ctx.state["own"] = depth
        return _ranked_paths([[a.tolist() for a in level] for level in levels])

    def _grow(self, ctx, last, depth, width):
        """``depth`` levels of ``(parent row, token, log-probability)`` arrays
        of ``width`` nodes each (lazy)."""
        views, pos, own, hidden, tok = self._start(ctx, last)
        score = mx.zeros((1,), mx.float32)
        levels = []
        for s in range(depth):
            hidden = self.net.step(
                hidden, self.embed(tok)[:, None], views, self.ropes, own, pos + s
            )
            logits = self.head(hidden)[:, -1, : self.vocab].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            top = mx.argpartition(-lp, width - 1, axis=-1)[:, :width]
            cand = (score[:, None] + mx.take_along_axis(lp, top, axis=-1)).reshape(-1)
            keep = mx.argpartition(-cand, width - 1)[:width]
            rows = keep // width
            tok, score = top.reshape(-1)[keep].astype(mx.uint32), cand[keep]
            levels.append((rows, tok, score))
            # Each kept node continues its parent's branch: its state and own K/V.
            hidden = hidden[rows]
            own = [[(k[rows], v[rows]) for k, v in layer] for layer in own]
        return levels

    def accept(self, ctx: DraftContext, tokens: list[int], n_drafted: int) -> None:
        ctx.state["own"] = 0
        if tokens:
            ctx.state["last"] = list(tokens[-1:])
        # Drafts made behind a verify hold for the round that kept what the
        # device found it keeps; any later token moves past them.
        ahead = ctx.state.pop("ahead", None)
        if ahead is not None and not ahead[2]:
            drafts, kept, _ = ahead
            if len(tokens) == n_drafted + 1 and kept.item() == n_drafted:
                ctx.state["ahead"] = (drafts, kept, True)

    def trim(self, ctx: DraftContext, n: int) -> None:
        # The history shrank behind the loop's back: the last token and the
        # hidden state no longer match, so draft nothing until told again.
        if n > 0:
            ctx.state["last"] = []
            ctx.state.pop("ahead", None)

    def flush(self, ctx: DraftContext) -> None:
        ctx.state["own"] = 0
        ctx.state.pop("ahead", None)


def _ranked_paths(levels: list[list[list]]) -> list[tuple[list[int], float]]:
    """The leaves' ``(path, weight)`` of ``_grow``'s levels (read back): a
    node's share is its parent's times its probability over its kept
    siblings' (the weights of the leaves under it sum to it)."""
    paths, share, score, kids = [[]], [1.0], [0.0], [0]
    prev = [0]
    for rows, toks, scores in levels:
        mass = {}
        for r, lp in zip(rows, scores, strict=True):
            mass[prev[r]] = mass.get(prev[r], 0.0) + math.exp(lp - score[prev[r]])
        here = []
        for r, t, lp in zip(rows, toks, scores, strict=True):
            parent = prev[r]
            paths.append(paths[parent] + [int(t)])
            share.append(share[parent] * math.exp(lp - score[parent]) / mass[parent])
            score.append(lp)
            kids.append(0)
            kids[parent] += 1
            here.append(len(paths) - 1)
        prev = here
    return [(p, w) for p, w, k in zip(paths, share, kids, strict=True) if k == 0 and p]
