"""Token-tree rounds of the verify loop: which tree to verify, which path
the target accepts, and the cache left holding exactly that path.

- Drafting: a drafter with ``draft_tree(ctx, n)`` proposes weighted paths;
  they merge into a trie (``tree.trie``) whose node shares, times the
  request's measured continuation rate per level, estimate how likely each
  node is to be accepted. ``tree.select`` keeps the nodes that raise the
  expected tokens per second under the controller's measured verify cost
  (``Controller.verify_cost``): where a wider forward costs, what is left is
  a chain, and the loop verifies it as any other chain.
- Acceptance is the one rule of chains and trees (``sampling.accept``):
  greedy follows the target's argmax down the tree; a custom sampler
  follows its own draw at each node; at temperature > 0 the siblings are
  tried in turn by recursive rejection (a drafted token ``x`` is kept with
  probability ``r(x) / mass(r)`` where ``r`` is the target's distribution
  less the siblings already rejected; when all are rejected the token is
  drawn from what is left). Each emitted token is distributed exactly as
  the target's own.
- The cache (``ragged.keep``, the rollback of both drivers): the tree
  forward appended every node; the accepted path's entries (not contiguous
  in general) are gathered into place right after the prefix, and the rest
  is trimmed. Keys there are already rotated at the path's depths, i.e. at
  the positions a chain would have given them.
"""

import logging
import time
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import policy, ragged, sampling
from . import target as target_mod
from . import tree as tree_mod

log = logging.getLogger("mlx_lm_spec_decode")


# --------------------------------------------------------- one request


class TreeRounds:
    """One request's trees: drafting, verifying and the continuation rate
    (accepted tokens over accepted plus rejections, decayed) that scales
    the drafter's shares into acceptance estimates."""

    DECAY = 0.9
    PRIOR = (1.5, 1.0)  # accepted, rejected before any round: a rate of 0.6
    KEPT_MIN = 4  # tree rounds whose kept tokens are compared before they judge trees
    RETRY = 16  # chain rounds, once trees did not pay, before one more tree

    def __init__(self, loop: Any):
        self.loop = loop
        self.acc, self.rej = self.PRIOR
        self.pending: Optional[tuple[list[int], list[int], list[int]]] = None
        # Decayed tokens the tree rounds emitted, and what their chains would
        # have: the estimates a tree is chosen by, checked against the target.
        self.kept = [0.0, 0.0, 0]  # tree tokens, chain tokens, tree rounds
        self.since = 0  # rounds since the last tree
        # A drafter that computes on the device (the assistant), not a lookup.
        self.computes = getattr(loop.drafter, "needs_hidden", False)

    @classmethod
    def start(cls, loop: Any) -> Optional["TreeRounds"]:
        """Trees for this request, or None: the drafter proposes trees and the
        option is on, the caches are plain ``KVCache`` and the model's
        attention takes a tree; otherwise chains (a log line says why)."""
        if not tree_mod.drafts_trees(loop.drafter):
            return None
        kinds = {type(c) for c in loop.target_cache}
        if kinds != {KVCache} or loop.kv_bits is not None:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            why = "a quantized KV cache (--kv-bits)" if kinds == {KVCache} else names
            log.info(f"spec-decode: token trees need plain KV caches, not {why}; drafting chains")
            return None
        if not tree_mod.tree_ok(loop.model, loop.attention):
            return None
        return cls(loop)

    @property
    def rate(self) -> float:
        return self.acc / (self.acc + self.rej)

    def grows(self, cost: Optional[tuple[float, float]]) -> bool:
        """Whether this round drafts a tree. A free drafter (a lookup) always
        offers one, which ``draft`` may cut to a chain; a drafter that pays a
        step per level (the assistant) only where the verify's columns are
        free (``policy.free_columns``): elsewhere the rule would cut its tree
        to a chain, which its own ``draft`` builds without a read-back."""
        return not self.computes or policy.free_columns(cost)

    def guess(self, n: int) -> list[int]:
        """The first token of the tree a free drafter would draft now, ``n``
        deep ([] where it proposes none, or computes its drafts)."""
        if self.computes:
            return []
        paths = self.loop.drafter.draft_tree(self.loop.ctx, n)
        return next(([int(path[0])] for path, _ in paths if len(path)), [])

    def draft(self, k_req: int, limit: int) -> tuple[Optional[mx.array], None]:
        """A chain to verify as usual (an array, maybe empty), or ``None``:
        a tree is pending for ``verify``."""
        loop = self.loop
        drafter = loop.drafter
        if not self.computes:
            loop.ctl.free_drafts()
            loop.free = True  # lists of ids: asking costs no forward
        cost = loop.ctl.verify_cost()
        # Budget: the controller's γ until the verify cost is measured, then
        # as many nodes as the cost rule and the request allow.
        depth = k_req if cost is None or not drafter.adaptive else max(k_req, limit)
        depth = min(depth, limit, tree_mod.MAX_NODES - 1)
        t0 = time.perf_counter()
        loop.ctx.computed = None
        paths = drafter.draft_tree(loop.ctx, depth)
        if not paths:
            return mx.array([], mx.uint32), None
        tokens, parents, shares = tree_mod.trie(paths)
        if self.computes:
            self._priced(len(tokens) - 1, time.perf_counter() - t0)
        probs = tree_mod.estimates(parents, shares, self.rate)
        width = k_req if cost is None else depth
        keep, chain = tree_mod.select(parents, probs, width, cost), []
        if cost is not None and not tree_mod.is_chain(tree_mod.subtree(tokens, parents, keep)[1]):
            # A branching tree only where it beats the chain at its measured
            # price, and while trees have kept what that promised (``pays``).
            chain = tree_mod.best_chain(parents, probs, width, cost)
            surcharge = loop.ctl.tree_surcharge()
            if not tree_mod.tree_pays(probs, keep, chain, cost, surcharge) or not self.pays(
                tree_mod.window_cost(cost, len(chain)), surcharge
            ):
                keep = chain
        self.since += 1
        chain_tokens = [tokens[i] for i in chain[1:]]
        tokens, parents = tree_mod.subtree(tokens, parents, keep)
        if tree_mod.is_chain(parents):
            return mx.array(tokens[1:], mx.uint32), None
        tokens[0] = loop.y
        self.pending = (tokens, parents, chain_tokens)
        self.since = 0
        return None, None

    def pays(self, chain_cost: float, surcharge: float) -> bool:
        """Whether trees have emitted enough more than their chains would
        have (the chain each tree round was chosen over, walked along the
        path the target took) to pay their surcharge over a chain's verify
        (``chain_cost`` plain steps, ``surcharge`` more for a tree): the
        shares a tree is weighed by are the drafter's guesses, and a wide
        lookup tree's older copies may be right less often than they say.
        Until ``KEPT_MIN`` tree rounds, and once every ``RETRY`` rounds after
        trees lost, a tree is tried."""
        tree, chain, n = self.kept
        if n < self.KEPT_MIN or self.since >= self.RETRY:
            return True
        return tree * chain_cost >= chain * (chain_cost + surcharge)

    def _priced(self, nodes: int, seconds: float) -> None:
        """A tree of a drafter on the device (the assistant) was read back:
        its computed nodes timed, one by one. A pair's tree that holds only
        its lookup's copies (``ctx.computed`` 0) cost nothing to draft."""
        loop = self.loop
        computed = nodes if loop.ctx.computed is None else loop.ctx.computed
        loop.round_free = computed == 0
        if computed and loop.ctl.time_draft():
            loop.ctl.drafted(computed, seconds)

    def verify(self) -> tuple[mx.array, list[int], int, int, int]:
        """The pending tree through one target forward: ``(logprobs rows of
        the emitted tokens, emitted tokens, accepted, drafted nodes, drafts
        the accepted path met)`` (the last: ``accepted``, plus one where the
        path ends in a rejection)."""
        loop = self.loop
        tokens, parents, chain = self.pending
        self.pending = None
        loop.st.tree_rounds += 1
        # Padded up to the loop's widths, as a chain is.
        n = len(tokens)
        fed = target_mod.padded_width(n, loop.widths)
        pad_t, pad_p = tree_mod.pad(tokens, parents, fed)
        out = tree_mod.forward(
            loop.model, loop.target_cache, pad_t, pad_p, loop.attention, loop.split
        )
        logits, hidden = out if loop.split is not None else (out, None)
        logits = logits[:n] if fed > n else logits
        # The loop's context ends with its pending token, the tree's root.
        before = loop.context[:-1] if loop.context is not None else None
        lp = sampling.window_logprobs(logits, loop.logits_processors, before, tokens, parents)
        path, tok = sampling.accept(sampling.Window(tokens, parents), lp, loop.rule)
        ragged.keep(loop.target_cache, fed, [path])
        a = len(path) - 1
        if hidden is not None:  # the state that produced the target's token
            loop.ctx.hidden = hidden[path[-1] : path[-1] + 1]
        out = [tokens[i] for i in path[1:]] + [int(tok)]
        rejected = bool(tree_mod.children(parents)[path[-1]])
        self.update(len(tokens) - 1, a, rejected)
        self.record(out[:-1], chain)
        return lp[mx.array(path, mx.int32)], out, a, len(tokens) - 1, a + rejected

    def record(self, accepted: list[int], chain: list[int]) -> None:
        """A tree round accepted ``accepted``: against the tokens its
        ``chain`` alone would have emitted (its prefix that the target kept,
        and the target's token after it), into ``kept``. The chain's count
        follows greedy acceptance; sampled, it is an estimate."""
        tree, alone, n = self.kept
        self.kept = [
            self.DECAY * tree + len(accepted) + 1,
            self.DECAY * alone + sampling.kept(chain, accepted) + 1,
            n + 1,
        ]

    def update(self, k: int, a: int, rejected: Optional[bool] = None) -> None:
        """A round verified ``k`` drafted nodes and accepted ``a``."""
        rejected = a < k if rejected is None else rejected
        self.acc = self.DECAY * self.acc + a
        self.rej = self.DECAY * self.rej + rejected
